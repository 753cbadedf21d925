"""pad_attention: every attention's query and key lengths padded to a multiple of ``block``, exactly.

Not part of ``PIPELINE``: the Neuron backend runs it on request (``pad_sequence=True``; ``run(gm, block) -> gm``,
in place), because Neuron's flash kernel takes only lengths that are multiples of 512 and takes no mask.

Without a mask, padded keys take softmax mass. So the keys are padded with copies of the first key and the values
with zeros, and attention runs twice on the padded q, k: once over the values (o1) and once over an indicator, 1 on
real key rows and 0 on padded ones (o2), with v's shape so the kernel sees the same head_dim. Both share the
softmax denominator Z + P * exp(s_0) (Z: the real keys' sum, s_0: the first key's score), so
    o1 / o2 = (sum over real keys of exp(s_j) v_j) / Z
is the attention over the real keys, exactly up to rounding. Copying a real key rather than padding with zero keys
keeps o2 >= 1 / (1 + P): zero keys score 0, and when every real score is far below 0 (below -87 in float32) both
o1 and o2 underflow to 0 and the ratio is NaN. Padded query rows are zeros and their outputs are cut off; a
query-only pad needs no second attention.

Cost: twice the attention FLOPs (the second pass recomputes the scores), on lengths rounded up to the block. No
cheaper exact form exists with torch's SDPA: it returns no log-sum-exp to merge a 512-multiple part with a
remainder, and at head_dim 128 (H3) v has no spare channel to carry the indicator in the same call.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from ..rules.attention import attention_options
from ..annotations import annotation

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def paddable(node: Node) -> bool:
    """No mask and no dropout; causal only with queries and keys of one length (then zero rows appended at the end
    are never seen by a real query, and the plain padded attention is exact)."""
    mask, dropout, causal = attention_options(node)
    same_length = node.args[0].meta["val"].shape[-2] == node.args[1].meta["val"].shape[-2]
    return mask is None and not dropout and (not causal or same_length)


def _add(gm: GraphModule, target, args: tuple, kwargs: dict | None = None, heads=None) -> Node:
    """``target(*args, **kwargs)`` at the graph's insertion point, its value computed on its inputs' fake values."""
    node = gm.graph.call_function(target, args, kwargs)
    if heads is not None:
        annotation(node).heads = heads
    node.meta["val"] = target(*map_arg(args, lambda n: n.meta["val"]), **map_arg(kwargs or {}, lambda n: n.meta["val"]))
    return node


def _padded(gm: GraphModule, x: Node, rows: int, copy_first: bool = False) -> Node:
    """``x`` with ``rows`` more rows along dim -2: zeros, or copies of its first row."""
    if not copy_first:
        return _add(gm, aten.constant_pad_nd.default, (x, [0, 0, 0, rows], 0.0))
    shape = list(x.meta["val"].shape)
    first = _add(gm, aten.slice.Tensor, (x, len(shape) - 2, 0, 1))
    copies = _add(gm, aten.expand.default, (first, shape[:-2] + [rows, shape[-1]]))
    return _add(gm, aten.cat.default, ([x, copies], len(shape) - 2))


def _pad(gm: GraphModule, node: Node, block: int) -> None:
    q, k, v = node.args[:3]
    q_rows, k_rows = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
    q_pad, k_pad = -q_rows % block, -k_rows % block
    options, kwargs = node.args[3:], node.kwargs  # scale and GQA as given (the default scale reads head_dim)
    heads = annotation(node).heads  # names the attention in Neuron's check
    previous = node.prev
    causal = attention_options(node)[2]
    with gm.graph.inserting_before(node):
        qp = _padded(gm, q, q_pad) if q_pad else q
        if causal:  # one length: later (padded) keys are masked out for every real query
            out = _add(gm, SDPA, (qp, _padded(gm, k, k_pad), _padded(gm, v, k_pad), *options), kwargs, heads)
        elif k_pad:
            kp, vp = _padded(gm, k, k_pad, copy_first=True), _padded(gm, v, k_pad)
            real = _padded(gm, _add(gm, aten.ones_like.default, (v,)), k_pad)  # 1 on real key rows, 0 on padded
            o1 = _add(gm, SDPA, (qp, kp, vp, *options), kwargs, heads)
            o2 = _add(gm, SDPA, (qp, kp, real, *options), kwargs, heads)
            out = _add(gm, aten.div.Tensor, (o1, o2))
        else:
            out = _add(gm, SDPA, (qp, k, v, *options), kwargs, heads)
        if q_pad:
            out = _add(gm, aten.slice.Tensor, (out, out.meta["val"].dim() - 2, 0, q_rows))
    while previous.next is not node:  # every new node: where it comes from, for dumps and tests
        previous = previous.next
        previous.meta.update({key: node.meta[key] for key in ("stack_trace", "nn_module_stack") if key in node.meta},
                             padded_attention=node.name)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def run(gm: GraphModule, block: int) -> GraphModule:
    for node in list(gm.graph.nodes):
        if node.target is not SDPA:
            continue
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        if (q.shape[-2] % block or k.shape[-2] % block) and paddable(node):  # else left for the check to report
            _pad(gm, node, block)
    return gm
