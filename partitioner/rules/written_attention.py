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
between two matmuls, only elementwise ops between the first matmul and the softmax), never by names or sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..placement import PackedShard, Partial, Shard, is_sharded
from .core import Decision, R, Unshardable, register_factory, shape_of
from .matmul import matmul
from .attention import FLEX_ATTENTION, RING_AXES

aten = torch.ops.aten
_MATMULS = (aten.matmul.default,)
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
    k: Node  # the keys, [batch, heads, rows, dim]
    v: Node


def _is_elementwise(node: Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _CASTS or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags))


def _scores_of(node: Node, shape: tuple, depth: int = 0) -> Node | None:
    """The matmul that ``node`` (shaped ``shape``) is computed from through elementwise ops of that shape."""
    if node.op != "call_function" or depth > _CHAIN_LIMIT:
        return None
    if node.target in _MATMULS:
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
    """``node`` as the last matmul of a written-out attention over 4-D ``[batch, heads, rows, dim]`` values."""
    if node.op != "call_function" or node.target not in _MATMULS or len(node.args) < 2:
        return None
    probabilities, v = node.args[:2]
    if not isinstance(probabilities, Node) or not isinstance(v, Node):
        return None
    softmax = probabilities
    while softmax.op == "call_function" and softmax.target in _CASTS and isinstance(softmax.args[0], Node):
        softmax = softmax.args[0]
    shape = shape_of(softmax)
    if softmax.target not in _SOFTMAX or shape is None or len(shape) != 4 or softmax.args[1] not in (-1, 3):
        return None
    scores = _scores_of(softmax.args[0], shape)
    if scores is None or not all(isinstance(a, Node) for a in scores.args[:2]):
        return None
    q, keys_t = scores.args[:2]
    if keys_t.target is not aten.transpose.int or sorted(d % 4 for d in keys_t.args[1:3]) != [2, 3]:
        return None
    k = keys_t.args[0]
    shapes = [shape_of(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes) or shapes[0][1] != shapes[1][1] or \
            shapes[1][:3] != shapes[2][:3]:
        return None  # (heads of q, k and v must match: grouped keys are repeated before a written attention)
    return WrittenAttention(scores, node, q, keys_t, k, v)


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


@register_factory(aten.matmul.default, axis="sequence")
def make_sequence_matmul(roles, axis: str):
    ring = axis in RING_AXES

    def sequence_matmul(node: Node, placements, axis_size: int) -> Decision:
        first = written_attention_from_scores(node)
        if first is not None:
            return _scores(first, placements, axis_size, ring)
        last = written_attention(node)
        if last is not None:
            return _output(last, placements, axis_size)
        return matmul(node, placements, axis_size)
    return sequence_matmul


def _scores(attention: WrittenAttention, placements, axis_size: int, ring: bool) -> Decision:
    """``q @ k^T``: on this rank's heads (Ulysses), or this rank's query rows over whole keys."""
    q, keys_t = attention.q, attention.keys_t
    pq, pk = placements.get(q, R), placements.get(keys_t, R)
    if not (is_sharded(pq) or is_sharded(pk)):
        return Decision(R, {q: R, keys_t: R})
    if isinstance(pq, PackedShard) or isinstance(pk, PackedShard):
        raise Unshardable("a written-out attention over a packed (joint) sequence")
    rows_q, rows_k = pq == Shard(2), pk == Shard(3)
    if not (rows_q or pq == R) or not (rows_k or pk == R):
        return matmul(attention.scores, placements, axis_size)  # (heads already split: a batch dim)
    heads = shape_of(q)[1]
    for split, rows in ((rows_q, shape_of(q)[2]), (rows_k, shape_of(keys_t)[3])):
        if split and rows < axis_size:
            raise Unshardable(f"a sequence of {rows} rows cannot be spread over a degree of {axis_size}")
    if not ring and heads >= axis_size and rows_k:  # (queries split over whole keys: on their own rows, below)
        return Decision(Shard(1), {q: Shard(1), keys_t: Shard(1)})
    if not rows_q:
        raise Unshardable("keys split along their rows reach a written-out attention whose queries are whole")
    return Decision(Shard(2), {q: Shard(2), keys_t: R})


def _output(attention: WrittenAttention, placements, axis_size: int) -> Decision:
    """``p @ v``: on the heads the scores ran on (values exchanged alike; consumers see the queries' rows), or on
    this rank's query rows with whole values; otherwise as any matmul."""
    probabilities, v = attention.output.args[:2]
    placed = placements.get(probabilities, R)
    if placed == Shard(1):
        queries = placements.get(attention.q, R)  # (what consumers see: the queries' rows, never a partial sum)
        return Decision(Shard(1), {probabilities: Shard(1), v: Shard(1)},
                        visible=R if isinstance(queries, Partial) else queries)
    if placed == Shard(2):
        return Decision(Shard(2), {probabilities: Shard(2), v: R})
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
