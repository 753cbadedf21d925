"""pointwise_convs: a 1x1 convolution is a Linear over the channel dim, and is rewritten as one, so that every rule
for Linears applies to it (column or row sharding over tp, the bias added after the sum, chunked all_reduces,
row by row over a sequence axis). Sana's feed-forward is two of them around a depthwise convolution::

    conv2d(x, W[out, in, 1, 1], b)
    # is, value for value (up to the matmul kernel's order of summation):
    linear(x.permute(0, 2, 3, 1), W.squeeze([2, 3]), b).permute(0, 3, 1, 2)

The weight stays the model's parameter; ``plan_sharding`` places it through the squeeze, so it is still cut when
it is loaded. Requires: nothing. Guarantees: no convolution with a kernel of ones, stride 1, no padding and one
group is left.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..rules.conv import conv_arguments, groups_of
from .context import PassContext

aten = torch.ops.aten
_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)


def is_pointwise(node: Node) -> bool:
    """A batched convolution that reads one pixel per output pixel, over all its channels: a Linear."""
    if node.target not in _CONVS or len(node.args) < 2 or node.kwargs:
        return False
    x, weight = (n.meta.get("val") for n in node.args[:2])
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == weight.dim()):
        return False
    stride, padding, dilation, _ = conv_arguments(node)
    return (set(weight.shape[2:]) == {1} and set(stride) == {1} and set(padding) == {0} and set(dilation) == {1}
            and groups_of(node) == 1)


def new_node(graph, target, args, like: Node, val) -> Node:
    """A call of ``target`` in ``graph`` (at its insertion point) with value ``val``, keeping the model source line
    and module stack of ``like``, the node it stands for."""
    node = graph.call_function(target, args)
    node.meta.update({key: like.meta[key] for key in ("stack_trace", "nn_module_stack") if key in like.meta})
    node.meta["val"] = val
    return node


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    del ctx
    graph = gm.graph
    for conv in [n for n in graph.nodes if is_pointwise(n)]:
        x, weight = conv.args[:2]
        bias = conv.args[2] if len(conv.args) > 2 else None
        ndim = len(x.meta["val"].shape)
        channels_last = [0, *range(2, ndim), 1]
        with graph.inserting_before(conv):
            moved = new_node(graph, aten.permute.default, (x, channels_last), conv,
                             x.meta["val"].permute(channels_last))
            matrix = new_node(graph, aten.squeeze.dims, (weight, list(range(2, ndim))), conv,
                              weight.meta["val"].squeeze(list(range(2, ndim))))
            linear = new_node(graph, aten.linear.default, (moved, matrix) + ((bias,) if bias is not None else ()),
                              conv, conv.meta["val"].permute(channels_last))
            back = new_node(graph, aten.permute.default, (linear, [0, ndim - 1, *range(1, ndim - 1)]), conv,
                            conv.meta["val"])
        conv.replace_all_uses_with(back)
        graph.erase_node(conv)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no pointwise convolution is left."""
    for node in gm.graph.nodes:
        if is_pointwise(node):
            raise InvariantError(f"{node.name}: a 1x1 convolution was not rewritten as a linear")
