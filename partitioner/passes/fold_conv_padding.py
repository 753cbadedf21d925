"""fold_conv_padding: zeros padded around a convolution's input become the convolution's own padding.

Causal video convolutions (Wan's VAE) pad every dim with ``F.pad`` and convolve with no padding; a VAE's strided
downsampling pads one side only (``F.pad(x, (0, 1, 0, 1))``) and convolves with stride 2. Folded, a convolution over
rows split across ranks reads its padding as the halo exchange provides it (zeros beyond the first and last rank
only), where a pad op of the split dim would put zeros at every rank's edge. Value for value the same: zero padding
is zero padding.

- padding equal on both sides of a spatial dim becomes the convolution's ``padding`` there;
- padding that differs on the two sides of a dim the convolution strides over (downsampling) makes the pair one
  ``collectives.padded_convolution`` (its padding ``[before, after]`` per dim);
- replicate or reflect padding (H3's encoder, BigVGAN's filters) makes the pair one ``padded_convolution`` of
  that mode: over split rows only the image's edges are padded so, the rows between ranks are the neighbours';
- one-sided zero padding of a dim of stride 1 (a causal time dim) stays a pad op before the convolution, as does
  a pad of the batch or channel dims.

Requires: nothing. Guarantees: no convolution reads a zero pad op it could take as its own padding.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..rules.conv import conv_arguments, groups_of
from ..runtime import collectives
from ..runtime.collectives import PAD_MODES
from .context import PassContext
from .pointwise_convs import new_node

aten = torch.ops.aten
_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)
_PADDING_ARGUMENT = 4  # aten.convolution's (input, weight, bias, stride, padding, ...)


def _pads(node: Node) -> tuple[list[int], str] | None:
    """The ``[last_before, last_after, ...]`` pads of a pad op and its mode ("constant": zeros, "replicate",
    "reflect"), else None (another constant, another mode)."""
    if node.op != "call_function":
        return None
    mode = "constant"
    if node.target is aten.constant_pad_nd.default:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    elif node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    else:
        return None
    return (list(node.args[1]), mode) if value in (0, 0.0, None) and mode in PAD_MODES else None


def folds(conv: Node) -> tuple[list[list[int]], list[int], str] | None:
    """For a convolution reading a pad: ``[before, after]`` padding of each spatial dim once the foldable pads
    are its own, the pads left to a pad op (all zero: none), and the padding's mode. None when nothing folds.
    Replicate and reflect padding fold whole (into a ``padded_convolution``) or not at all."""
    if conv.target not in _CONVS or not isinstance(conv.args[0], Node) or conv.kwargs or conv_arguments(conv)[3]:
        return None
    found = _pads(conv.args[0])
    spatial = len(conv.args[0].meta["val"].shape) - 2
    if found is None or any(found[0][2 * spatial:]) or min(found[0]) < 0:  # batch or channels padded, or a crop
        return None
    pads, mode = found
    stride, padding, _, _ = conv_arguments(conv)
    if mode != "constant":
        if any(padding):  # zeros around another mode's padding: left as it is
            return None
        pads = pads + [0] * (2 * spatial - len(pads))
        pairs = [[pads[2 * (spatial - 1 - dim)], pads[2 * (spatial - 1 - dim) + 1]] for dim in range(spatial)]
        return pairs, [0] * len(pads), mode
    pads = pads + [0] * (2 * spatial - len(pads))
    pairs, left = [], list(pads)
    for dim in range(spatial):
        index = 2 * (spatial - 1 - dim)  # pads run from the last dim backwards
        before, after = pads[index], pads[index + 1]
        if before or after:
            if before == after or stride[dim] > 1:
                left[index] = left[index + 1] = 0
            else:
                before = after = 0
        pairs.append([padding[dim] + before, padding[dim] + after])
    return (pairs, left, mode) if left != pads else None


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    del ctx
    graph = gm.graph
    for conv, (pairs, left, mode) in [(n, found) for n in graph.nodes if (found := folds(n))]:
        pad = conv.args[0]
        source = pad.args[0]
        if any(left):
            with graph.inserting_after(pad):
                source = new_node(graph, aten.constant_pad_nd.default, (source, left, 0.0), pad,
                                  aten.constant_pad_nd.default(source.meta["val"], left, 0.0))
        stride, _, dilation, _ = conv_arguments(conv)
        bias = conv.args[2] if len(conv.args) > 2 else None
        if mode == "constant" and all(before == after for before, after in pairs):
            padding = [before for before, _ in pairs]
            if conv.target is aten.convolution.default:
                args = list(conv.args)
                args[0], args[_PADDING_ARGUMENT] = source, padding
                conv.args = tuple(args)
            else:
                conv.args = (source, conv.args[1], bias, stride, padding, dilation, groups_of(conv))
        else:
            with graph.inserting_before(conv):
                padded = new_node(graph, collectives.padded_convolution, (
                    source, conv.args[1], bias, stride, pairs, dilation, groups_of(conv), mode), conv, conv.meta["val"])
            conv.replace_all_uses_with(padded)
            graph.erase_node(conv)
        if not pad.users:
            graph.erase_node(pad)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no foldable padding is left."""
    for node in gm.graph.nodes:
        if folds(node):
            raise InvariantError(f"{node.name}: its input's zero padding was not folded into the convolution")
