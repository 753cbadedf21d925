"""fold_conv_padding: zeros padded around a convolution's input, the same on both sides of a spatial dim, become the
convolution's own padding along that dim. Causal video convolutions (Wan's, H3's VAE) pad every dim with ``F.pad``
and convolve with no padding; folded, a convolution over rows split across ranks reads its padding as the halo
exchange expects (zeros beyond the first and last rank only), where a pad of the split dim would have put zeros on
every rank's edge. Value for value the same: zero padding is zero padding. Padding on one side only (a causal time
dim) and any other padding mode are left to a pad op before the convolution.

Requires: nothing. Guarantees: no convolution reads a zero pad op that pads one of its spatial dims equally on both
sides.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..rules.conv import conv_arguments, groups_of
from .context import PassContext

aten = torch.ops.aten
_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)
_PADDING_ARGUMENT = 4  # aten.convolution's (input, weight, bias, stride, padding, ...)


def _zero_pad(node: Node) -> list[int] | None:
    """The ``[last_left, last_right, ...]`` pads of a constant zero pad op, else None."""
    if node.op != "call_function" or node.kwargs.get("value", 0) not in (0, 0.0, None):
        return None
    if node.target is aten.constant_pad_nd.default:
        value = node.args[2] if len(node.args) > 2 else 0
    elif node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
        if mode != "constant":
            return None
    else:
        return None
    return list(node.args[1]) if value in (0, 0.0, None) else None


def foldable(conv: Node) -> dict[int, int]:
    """The spatial dims (index among them) whose zero padding of ``conv``'s input can be the convolution's, with
    that padding: padded equally on both sides, not negative (a crop), the convolution not transposed."""
    if conv.target not in _CONVS or not isinstance(conv.args[0], Node) or conv.kwargs or conv_arguments(conv)[3]:
        return {}
    x = conv.args[0]
    pads = _zero_pad(x)
    if pads is None:
        return {}
    spatial = len(x.meta["val"].shape) - 2
    folds = {}
    for index in range(min(spatial, len(pads) // 2)):  # pads run from the last dim backwards
        left, right = pads[2 * index], pads[2 * index + 1]
        if left == right > 0:
            folds[spatial - 1 - index] = left
    return folds


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    del ctx
    graph = gm.graph
    for conv in [n for n in graph.nodes if foldable(n)]:
        pad, folds = conv.args[0], foldable(conv)
        source, pads = pad.args[0], list(pad.args[1])
        spatial = len(source.meta["val"].shape) - 2
        for dim in folds:
            index = spatial - 1 - dim
            pads[2 * index] = pads[2 * index + 1] = 0
        stride, padding, dilation, _ = conv_arguments(conv)
        padding = [p + folds.get(dim, 0) for dim, p in enumerate(padding)]
        if any(pads):
            with graph.inserting_after(pad):
                rest = graph.call_function(aten.constant_pad_nd.default, (source, pads, 0.0))
            rest.meta.update({k: pad.meta[k] for k in ("stack_trace", "nn_module_stack") if k in pad.meta})
            rest.meta["val"] = torch.ops.aten.constant_pad_nd.default(source.meta["val"], pads, 0.0)
        else:
            rest = source
        if conv.target is aten.convolution.default:
            args = list(conv.args)
            args[0], args[_PADDING_ARGUMENT] = rest, padding
        else:
            args = [rest, conv.args[1], conv.args[2] if len(conv.args) > 2 else None, stride, padding, dilation,
                    groups_of(conv)]
        conv.args = tuple(args)
        if not pad.users:
            graph.erase_node(pad)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no foldable padding is left."""
    for node in gm.graph.nodes:
        if foldable(node):
            raise InvariantError(f"{node.name}: its input's zero padding was not folded into the convolution")
