"""scaled_dot_product_attention: head (or batch) sharding for tensor parallelism; the Ulysses exchange for a
sequence axis."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from ..placement import PackedShard, Shard
from .core import R, Decision, Unshardable, register, register_factory, replicate_all, shape_of, sharded_inputs

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default)
def attention(node: Node, placements, axis_size: int) -> Decision:
    """scaled_dot_product_attention on (batch, heads, seq, head_dim): heads (and batch) may be sharded; q, k and v
    share the sharding; a replicated q/k/v is sliced to it."""
    q, k, v = node.args[:3]
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    dims = {p.dim for n, p in sharded.items() if n in (q, k, v)}
    if len(dims) != 1 or any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable("query, key and value are sharded differently")
    dim = dims.pop()
    if dim not in (0, 1):
        raise Unshardable(f"attention over a sequence or head_dim sharded on dim {dim}")
    if dim == 1 and shape_of(k)[1] != shape_of(q)[1]:
        raise Unshardable("grouped-query attention (fewer key/value heads) is not sharded by heads yet")
    inputs = {n: Shard(dim) for n in (q, k, v)}
    for n in node.all_input_nodes:
        if n not in inputs:  # an attention mask broadcasts like a pointwise operand
            shape = shape_of(n)
            local = dim - (4 - len(shape))
            inputs[n] = R if local < 0 or shape[local] == 1 else Shard(local)
    return Decision(Shard(dim), inputs)



RING_AXES = ("ring",)


def ring_attention(node: Node, placements, axis_size: int) -> Decision:
    """Ring attention: q, k and v sharded along the sequence stay where they are; key/value blocks travel round the
    ring and each rank attends its query rows over every block (``collectives.ring_attention``, put in by
    insert_collectives). The output keeps the queries' rows. Row order does not matter to keys (no mask, not
    causal), so a packed joint sequence works as it is."""
    q, k, v = node.args[:3]
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return attention(node, placements, axis_size)
    masks = [n for n in node.all_input_nodes if n not in (q, k, v)]
    if any(n in sharded for n in masks):
        raise Unshardable("a mask sharded along the sequence (ring attention with a mask is not supported yet)")
    if q not in sharded or any(placements[n].dim != 2 for n in (q, k, v) if n in sharded):
        raise Unshardable("ring attention needs the query rows sharded along the sequence (dim 2)")
    if k not in sharded and v not in sharded:
        return _query_rows(node, placements, masks)
    _, dropout, causal = attention_options(node)
    if masks or causal or dropout:
        raise Unshardable("ring attention with a mask, causal, or with dropout is not supported yet")
    if placements.get(k) != placements.get(v):
        raise Unshardable(f"ring attention needs keys and values laid out alike ({placements.get(k)} and "
                          f"{placements.get(v)})")
    if shape_of(k)[1] != shape_of(q)[1]:
        raise Unshardable("ring attention with fewer key/value heads than query heads (GQA)")
    if shape_of(k)[2] < axis_size:
        raise Unshardable(f"{shape_of(k)[2]} key rows cannot be spread over a ring of {axis_size}")
    return Decision(placements[q], {q: placements[q], k: placements[k], v: placements[v]})


def attention_options(node: Node) -> tuple:
    """(attn_mask, dropout_p, is_causal) of a scaled_dot_product_attention node."""
    def option(index: int, name: str, default):
        return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
    return option(3, "attn_mask", None), option(4, "dropout_p", 0.0), option(5, "is_causal", False)


@register_factory(aten.scaled_dot_product_attention.default, axis="sequence")
def make_sequence_attention(roles, axis: str) -> Callable:
    if axis in RING_AXES:
        return ring_attention

    def sequence_attention(node: Node, placements, axis_size: int) -> Decision:
        """Ulysses: q/k/v sharded along the sequence are exchanged (all_to_all) to be sharded along heads, the
        attention runs over the whole sequence for this rank's heads, and the output goes back to sequence
        sharding. Heads or sequence lengths that do not divide the degree split unevenly; nothing is padded."""
        q, k, v = node.args[:3]
        sharded = sharded_inputs(node, placements)
        if not any(n in sharded for n in (q, k, v)) or any(p.dim != 2 for p in sharded.values()):
            return attention(node, placements, axis_size)
        masks = [n for n in node.all_input_nodes if n not in (q, k, v)]
        packed = any(isinstance(p, PackedShard) for p in sharded.values())
        causal = (node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
        if causal and (packed or (q in sharded and k not in sharded)):
            raise Unshardable("causal attention over rows that are not in sequence order on this rank")
        if packed and placements.get(k) != placements.get(v):
            raise Unshardable("a packed sequence (joint text + image rows) reaches the exchange in rank order, "
                              "so keys and values must be packed alike (q, k, v: "
                              f"{[str(placements.get(n, R)) for n in (q, k, v)]})")
        if q in sharded and k not in sharded and v not in sharded:
            if packed and masks:
                raise Unshardable("a mask over packed query rows (a joint sequence) kept on their ranks")
            if shape_of(q)[2] < axis_size:
                raise Unshardable(f"{node.name}: {shape_of(q)[2]} query rows cannot be spread over a {axis} degree "
                                  f"of {axis_size}")
            return _query_rows(node, placements, masks)
        if any(n in sharded for n in masks):
            raise Unshardable("a mask sharded along the sequence (Ulysses needs it whole, per head)")
        if shape_of(k)[2] != shape_of(q)[2] or shape_of(k)[1] != shape_of(q)[1] or q not in sharded:
            raise Unshardable("sequence-parallel attention needs self-attention with as many key as query heads")
        info = node.meta.get("heads")
        where = info.module if info is not None else node.name
        # More ranks than the heads a tp rank holds is correct but leaves ranks without heads; more ranks than
        # the model has heads is refused.
        # Too few heads or rows for the degree: this attention is left whole (the planner records why).
        heads = shape_of(q)[1]
        if heads < axis_size:
            raise Unshardable(f"{where}: {heads} attention heads cannot be spread over a {axis} degree of "
                              f"{axis_size} (at most {heads})")
        if shape_of(q)[2] < axis_size:
            raise Unshardable(f"{where}: a sequence of {shape_of(q)[2]} rows cannot be spread over a {axis} "
                              f"degree of {axis_size}")
        # a mask (batch, heads or 1, q rows, k rows) goes whole to the exchange: cut to this rank's heads
        inputs = {q: Shard(1), k: Shard(1), v: Shard(1)}
        inputs.update({mask: _along(mask, 1) for mask in masks})
        # Rows arrive in rank order: a packed (joint) sequence is permuted, the same way for keys and values, which
        # attention does not see (a mask is permuted alike by insert_collectives); the output goes back to the
        # queries' own layout by the inverse exchange.
        return Decision(Shard(1), inputs, visible=placements[q])
    return sequence_attention


def _along(mask: Node, dim: int):
    """A mask broadcast against (batch, heads, q rows, k rows), cut along ``dim`` where it is not broadcast."""
    shape = shape_of(mask)
    local = dim - (4 - len(shape))
    return R if local < 0 or shape[local] == 1 else Shard(local)


def _query_rows(node: Node, placements, masks: list[Node]) -> Decision:
    """Only the queries are sequence-sharded, keys and values whole (cross-attention to the text, or attention to
    a short context): every query row attends over every key on its own rank, so this rank's rows of the output
    need no communication; a mask is cut to the same query rows."""
    q, k, v = node.args[:3]
    inputs = {q: placements[q], k: R, v: R}
    inputs.update({mask: _along(mask, 2) for mask in masks})
    return Decision(placements[q], inputs)
