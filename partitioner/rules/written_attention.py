"""Attention written out by hand: ``softmax(f(q @ k^T)) @ v``, where ``f`` is any chain of elementwise ops on the
scores (a scale, Gemma's soft cap ``tanh(s / c) * c``, an additive or ``where`` mask, casts), as transformers'
``eager_attention_forward`` and older attention processors write it. Every op of it acts per (batch, head), like
``scaled_dot_product_attention``, so it is sequence-sharded as one:

- Ulysses: queries and keys whose rows are split are exchanged to head sharding before ``q @ k^T`` (``k^T``
  exchanged as it is read), the scores, the mask and the softmax run on this rank's heads over whole sequences,
  values are exchanged alike before ``p @ v``, and the output goes back to the queries' rows (consumers see the
  queries' placement, as for SDPA);
- too few heads for the degree, a ring axis, or keys kept whole: each rank's query rows attend over whole keys and
  values (gathered where they were split), and the output keeps the query rows: exact, no exchange back;
- fewer rows than the degree: left whole (as for SDPA).

``written_attention(node)`` recognises the pattern at its last matmul by op semantics (a softmax over the last dim
between two matmuls, only elementwise ops between the first matmul and the softmax), never by names or sizes. The
values are ``[batch, heads, rows, dim]``, or ``[batch * heads, rows, dim]`` as diffusers' classic ``AttnProcessor``
folds them (``bmm``, its scores a ``baddbmm`` that adds a mask or an empty tensor scaled by zero): every slice along
the folded dim is one (batch, head), split like heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..placement import PackedShard, Partial, Shard, is_sharded
from .core import Decision, R, Unshardable, register_factory, shape_of
from .matmul import baddbmm, matmul
from .attention import FLEX_ATTENTION, RING_AXES

aten = torch.ops.aten
_MATMULS = (aten.matmul.default, aten.bmm.default)
_SCORES = _MATMULS + (aten.baddbmm.default,)  # (beta * mask + alpha * q @ k^T: elementwise on the product)
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.clone.default, aten.contiguous.default,
          aten.alias.default)
_CHAIN_LIMIT = 16  # elementwise ops between the scores and the softmax (Gemma 2's scale, cap and mask: 5)


@dataclass(frozen=True)
class WrittenAttention:
    scores: Node  # q @ k^T
    output: Node  # softmax(...) @ v
    q: Node
    keys_t: Node  # k^T as the scores read it
    k: Node  # the keys, [batch, heads, rows, dim] or [batch * heads, rows, dim]
    v: Node
    added: Node | None = None  # what a baddbmm adds to the scores (a mask, or an empty tensor it scales by zero)

    @property
    def heads_dim(self) -> int:
        """The dim whose slices are independent attentions: heads, or batch and heads folded into one."""
        return len(shape_of(self.q)) - 3

    @property
    def rows_dim(self) -> int:
        return len(shape_of(self.q)) - 2


def _is_elementwise(node: Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _CASTS or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags))


def _scores_of(node: Node, shape: tuple, depth: int = 0) -> Node | None:
    """The matmul that ``node`` (shaped ``shape``) is computed from through elementwise ops of that shape."""
    if node.op != "call_function" or depth > _CHAIN_LIMIT:
        return None
    if node.target in _SCORES:
        return node
    if not _is_elementwise(node):
        return None
    for source in node.all_input_nodes:
        if shape_of(source) == shape:
            found = _scores_of(source, shape, depth + 1)
            if found is not None:
                return found
    return None


def written_attention(node: Node) -> WrittenAttention | None:
    """``node`` as the last matmul of a written-out attention over ``[batch, heads, rows, dim]`` values (or their
    3-D ``[batch * heads, rows, dim]`` fold)."""
    if node.op != "call_function" or node.target not in _MATMULS or len(node.args) < 2:
        return None
    probabilities, v = node.args[:2]
    if not isinstance(probabilities, Node) or not isinstance(v, Node):
        return None
    softmax = probabilities
    while softmax.op == "call_function" and softmax.target in _CASTS and isinstance(softmax.args[0], Node):
        softmax = softmax.args[0]
    shape = shape_of(softmax)
    if softmax.target not in _SOFTMAX or shape is None or len(shape) not in (3, 4) or \
            softmax.args[1] not in (-1, len(shape) - 1):
        return None
    ndim = len(shape)
    scores = _scores_of(softmax.args[0], shape)
    if scores is None:
        return None
    operands = scores.args[1:3] if scores.target is aten.baddbmm.default else scores.args[:2]
    if len(operands) != 2 or not all(isinstance(a, Node) for a in operands):
        return None
    q, keys_t = operands
    if keys_t.target is not aten.transpose.int or sorted(d % ndim for d in keys_t.args[1:3]) != [ndim - 2, ndim - 1]:
        return None
    k = keys_t.args[0]
    shapes = [shape_of(x) for x in (q, k, v)]
    if any(s is None or len(s) != ndim for s in shapes) or shapes[0][ndim - 3] != shapes[1][ndim - 3] or \
            shapes[1][:-1] != shapes[2][:-1]:
        return None  # (heads of q, k and v must match: grouped keys are repeated before a written attention)
    added = scores.args[0] if scores.target is aten.baddbmm.default and isinstance(scores.args[0], Node) else None
    return WrittenAttention(scores, node, q, keys_t, k, v, added)


def written_attention_from_scores(node: Node) -> WrittenAttention | None:
    """The written attention whose first matmul (``q @ k^T``) is ``node``."""
    for user in _downstream(node):
        found = written_attention(user)
        if found is not None and found.scores is node:
            return found
    return None


def _downstream(node: Node, depth: int = 0):
    """Matmuls reached from ``node`` through elementwise ops and a softmax (the way to a written attention's end)."""
    for user in node.users:
        if user.target in _MATMULS:
            yield user
        elif depth < _CHAIN_LIMIT + 8 and (_is_elementwise(user) or user.target in _SOFTMAX):
            yield from _downstream(user, depth + 1)


def make_sequence_matmul(roles, axis: str):
    ring = axis in RING_AXES

    def sequence_matmul(node: Node, placements, axis_size: int) -> Decision:
        first = written_attention_from_scores(node)
        if first is not None:
            return _scores(first, placements, axis_size, ring)
        last = written_attention(node)
        if last is not None:
            return _output(last, placements, axis_size)
        return (baddbmm if node.target is aten.baddbmm.default else matmul)(node, placements, axis_size)
    return sequence_matmul


for _target in _SCORES:
    register_factory(_target, axis="sequence")(make_sequence_matmul)


def _along(attention: WrittenAttention, dim: int, decided: dict) -> dict:
    """``decided`` plus what a baddbmm adds to the scores, split along the scores' ``dim`` where it has that dim
    (aligned from the right: it broadcasts), else whole."""
    added = attention.added
    if added is None:
        return decided
    shape, ndim = shape_of(added), len(shape_of(attention.scores))
    own = dim - (ndim - len(shape))
    return {**decided, added: Shard(own) if own >= 0 and shape[own] > 1 else R}


def _scores(attention: WrittenAttention, placements, axis_size: int, ring: bool) -> Decision:
    """``q @ k^T``: on this rank's heads (Ulysses), or this rank's query rows over whole keys."""
    q, keys_t, h, r = attention.q, attention.keys_t, attention.heads_dim, attention.rows_dim
    pq, pk = placements.get(q, R), placements.get(keys_t, R)
    if not (is_sharded(pq) or is_sharded(pk)):
        return Decision(R, {q: R, keys_t: R} | ({} if attention.added is None else {attention.added: R}))
    if isinstance(pq, PackedShard) or isinstance(pk, PackedShard):
        raise Unshardable("a written-out attention over a packed (joint) sequence")
    rows_q, rows_k = pq == Shard(r), pk == Shard(r + 1)
    if not (rows_q or pq == R) or not (rows_k or pk == R):
        # (heads already split: a batch dim)
        return (baddbmm if attention.scores.target is aten.baddbmm.default else matmul)(
            attention.scores, placements, axis_size)
    heads = shape_of(q)[h]
    for split, rows in ((rows_q, shape_of(q)[r]), (rows_k, shape_of(keys_t)[r + 1])):
        if split and rows < axis_size:
            raise Unshardable(f"a sequence of {rows} rows cannot be spread over a degree of {axis_size}")
    if not ring and heads >= axis_size and rows_k:  # (queries split over whole keys: on their own rows, below)
        return Decision(Shard(h), _along(attention, h, {q: Shard(h), keys_t: Shard(h)}))
    if not rows_q:
        raise Unshardable("keys split along their rows reach a written-out attention whose queries are whole")
    return Decision(Shard(r), _along(attention, r, {q: Shard(r), keys_t: R}))


def _output(attention: WrittenAttention, placements, axis_size: int) -> Decision:
    """``p @ v``: on the heads the scores ran on (values exchanged alike; consumers see the queries' rows), or on
    this rank's query rows with whole values; otherwise as any matmul."""
    probabilities, v = attention.output.args[:2]
    placed, h, r = placements.get(probabilities, R), attention.heads_dim, attention.rows_dim
    if placed == Shard(h):
        queries = placements.get(attention.q, R)  # (what consumers see: the queries' rows, never a partial sum)
        return Decision(Shard(h), {probabilities: Shard(h), v: Shard(h)},
                        visible=R if isinstance(queries, Partial) else queries)
    if placed == Shard(r):
        return Decision(Shard(r), {probabilities: Shard(r), v: R})
    return matmul(attention.output, placements, axis_size)


def attention_operands(node: Node) -> tuple[Node, Node, Node] | None:
    """(q, k, v) of an attention: ``scaled_dot_product_attention``, ``flex_attention``, or a written-out one ending
    at ``node``."""
    if node.op != "call_function":
        return None
    if node.target in (aten.scaled_dot_product_attention.default, FLEX_ATTENTION):
        return tuple(node.args[:3])
    found = written_attention(node)
    return None if found is None else (found.q, found.k, found.v)
