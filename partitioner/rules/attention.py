"""scaled_dot_product_attention: head (or batch) sharding for tensor parallelism; the Ulysses exchange for a
sequence axis."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from ..placement import PackedShard, Shard, is_sharded, packed_shard
from .core import (Decision, R, Unshardable, register, register_factory, replicate_all, shape_of, sharded_inputs,
                   with_dim)
from ..annotations import annotation

aten = torch.ops.aten
FLEX_ATTENTION = torch.ops.higher_order.flex_attention


# the index arguments of flex_attention's score_mod (score, b, h, q_idx, kv_idx, *buffers) and of its block mask's
# mask_mod (b, h, q_idx, kv_idx, *buffers), by the dim of q, k and v they count along
FLEX_SCORE_INDEX, FLEX_MASK_INDEX = {0: 1, 1: 2}, {0: 0, 1: 1}


def _block_mask_tensors(node: Node) -> list[Node]:
    """The block mask's tensors of a flex_attention as torch.export records it: ``flex_attention(q, k, v,
    score_mod, block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers)``, the block mask a tuple of
    q_len, kv_len, then kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices (each (batch, heads, ...) or None), then block sizes, in newer torch block
    orders for the backward pass, and its mask_mod."""
    return [n for n in node.args[4][2:10] if isinstance(n, Node)]


def _flex_inputs(node: Node, dim: int) -> dict[Node, object]:
    """What a flex_attention split along ``dim`` (0: batch, 1: heads) takes: q, k and v split along it, the block
    mask's tensors split with them or whole where they broadcast over that dim, everything else whole (the
    score_mod and mask_mod graphs, their buffers, the backward pass's block orders)."""
    inputs = {n: R for n in node.all_input_nodes}
    inputs.update({n: R if shape_of(n)[dim] == 1 else Shard(dim) for n in _block_mask_tensors(node)})
    inputs.update({n: Shard(dim) for n in node.args[:3]})
    return inputs


@register(FLEX_ATTENTION)
def flex_attention(node: Node, placements, axis_size: int) -> Decision:
    """``flex_attention`` on (batch, heads, seq, head_dim), like scaled_dot_product_attention: heads (or batch)
    may be sharded. Its ``score_mod`` and its block mask's ``mask_mod`` see global indices: a rank's program adds
    its first head (batch) to the index they read (``localize``); the block mask's tensors are sliced with the
    heads they name, or taken whole where they broadcast over them. Its query and key indices are global: its
    rows are never split here (a sequence axis exchanges them to heads, ``make_sequence_flex_attention``)."""
    q, k, v = node.args[:3]
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    # (a block mask computed from q and k per head, NABLA's, arrives split by heads as they are)
    if set(sharded) - {q, k, v, *_block_mask_tensors(node)}:
        raise Unshardable("flex_attention with a score_mod buffer sharded: its buffers are taken whole")
    dims = {p.dim for p in sharded.values()}
    if len(dims) != 1 or any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable("query, key, value and block mask are sharded differently")
    dim = dims.pop()
    if dim not in (0, 1):
        raise Unshardable(f"flex_attention is not split along dim {dim}: its score_mod and block mask read global "
                          "query and key indices, which a shard of rows would shift")
    if dim == 1 and shape_of(k)[1] != shape_of(q)[1]:
        raise Unshardable("grouped-query flex_attention (fewer key/value heads) is not sharded by heads yet")
    # (output, logsumexp[, max]): each (batch, heads, ...)
    return Decision(tuple(Shard(dim) for _ in node.meta["val"]), _flex_inputs(node, dim))


@register_factory(FLEX_ATTENTION, axis="sequence")
def make_sequence_flex_attention(roles, axis: str) -> Callable:
    def sequence_flex_attention(node: Node, placements, axis_size: int) -> Decision:
        """Ulysses for flex_attention: q, k and v sharded along their rows are exchanged to be sharded along
        heads (one left whole, a context every row attends to, is sliced to heads for free), and the attention
        runs over whole sequences (its query and key indices global, its head index made global by
        ``localize``); the output and logsumexp go back to the queries' rows. Rows packed from parts (a joint
        sequence) arrive in rank order and are put back in sequence order for it (``collective_kernels``): its
        score_mod and block mask read the indices. A rank left without heads computes nothing (``localize``).
        Refused: a ring (no ring form of flex_attention), a block mask split along the rows, key/value groups."""
        q, k, v = node.args[:3]
        sharded = sharded_inputs(node, placements)
        if not any(n in sharded for n in (q, k, v)) or any(p.dim != 2 for p in sharded.values()):
            return flex_attention(node, placements, axis_size)
        info = annotation(node).heads
        where = info.module if info is not None else node.name
        if axis in RING_AXES:
            raise Unshardable("no ring form of flex_attention here: it runs whole over the sequence", where)
        if set(sharded) - {q, k, v}:
            raise Unshardable("flex_attention with its block mask split along the rows: it reads the mask whole "
                              "over both sequences", where)
        heads = shape_of(q)[1]
        if shape_of(k)[1] != heads:
            raise Unshardable("grouped-query flex_attention (fewer key/value heads) is not exchanged yet", where)
        if heads < axis_size:
            raise Unshardable(f"{heads} attention heads cannot be spread over a {axis} degree of {axis_size}", where)
        outputs = node.meta["val"]  # (output, logsumexp[, max]): each (batch, heads, rows, ...)
        seen = placements.get(q, R)  # (queries whole: the output is gathered by heads)
        return Decision(tuple(Shard(1) for _ in outputs), _flex_inputs(node, 1), visible=tuple(seen for _ in outputs))
    return sequence_flex_attention


@register(aten.scaled_dot_product_attention.default)
def attention(node: Node, placements, axis_size: int) -> Decision:
    """scaled_dot_product_attention on (batch, heads, seq, head_dim): heads (and batch) may be sharded; q, k and v
    share the sharding; a replicated q/k/v is sliced to it."""
    q, k, v = node.args[:3]
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    if len(shape_of(q)) != 4:  # (3-D: its dim 1 is the rows, not heads)
        raise Unshardable(f"scaled_dot_product_attention over {len(shape_of(q))}-D values (no heads dim)")
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


def ring_split_axes(node: Node) -> list[str]:
    """The ring axes whose planned placements split an attention's keys along their rows: that attention is a ring
    attention over them (keys split along the batch, frames for an attention within each frame, are each rank's
    own: no ring)."""
    k, required = node.args[1], annotation(node).required or {}
    return [axis for axis in RING_AXES if axis in required and is_sharded(keys := required[axis].get(k, R))
            and keys.dim == len(shape_of(k)) - 2]


def ring_attention(node: Node, placements, axis_size: int) -> Decision:
    """Ring attention: q, k and v sharded along the sequence stay where they are; key/value blocks travel round the
    ring and each rank attends its query rows over every block (``collectives.ring_attention``, put in by
    insert_collectives). The output keeps the queries' rows. Row order does not matter to keys (no mask, not
    causal), so a packed joint sequence works as it is."""
    q, k, v = node.args[:3]
    sharded = sharded_inputs(node, placements)
    if not sharded or all(p.dim < 2 for p in sharded.values()):  # (by batch entries or heads: each rank's own)
        return attention(node, placements, axis_size)
    masks = [n for n in node.all_input_nodes if n not in (q, k, v)]
    if any(n in sharded for n in masks):
        raise Unshardable("a mask sharded along the sequence (ring attention takes it whole, cut to its rows)")
    if q not in sharded or any(placements[n].dim != 2 for n in (q, k, v) if n in sharded):
        raise Unshardable("ring attention needs the query rows sharded along the sequence (dim 2)")
    if k not in sharded and v not in sharded:
        return _query_rows(node, placements, masks)
    _, dropout, causal = attention_options(node)
    if causal or dropout:
        raise Unshardable("ring attention that is causal or has dropout is not supported yet")
    rows = _keys_and_values_alike(placements.get(k, R), placements.get(v, R))
    _gqa_group(node, shape_of(q)[1], shape_of(k)[1])  # (grouped-query: the kernel widens each block's heads)
    if shape_of(k)[2] < axis_size:
        raise Unshardable(f"{shape_of(k)[2]} key rows cannot be spread over a ring of {axis_size}")
    # a mask is cut to this rank's query rows (as the queries are laid out); its key columns stay whole, each
    # step of the ring picking the columns of the block it holds (collectives.ring_attention)
    inputs = {q: placements[q], k: rows, v: rows}
    inputs.update({mask: _rows_like(mask, placements[q]) for mask in masks})
    return Decision(placements[q], inputs)


def _keys_and_values_alike(keys, values):
    """The one row layout keys and values travel the ring in: theirs when alike; a whole one is cut as the other
    is (a free local slice of this rank's rows: Ernie-Image's values are computed whole, its keys sharded)."""
    if keys == values or values == R:
        return keys
    if keys == R:
        return values
    raise Unshardable(f"ring attention needs keys and values laid out alike ({keys} and {values})")


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
        """Ulysses: q/k/v sharded along their sequences are exchanged (all_to_all) to be sharded along heads, the
        attention runs over whole sequences for this rank's heads, and the output goes back to the queries'
        sharding. Queries and keys may be different sequences (one modality attending to another) and keys may
        have fewer heads (grouped-query attention: each rank takes whole groups). Heads or rows that do not
        divide the degree split unevenly; nothing is padded. Queries sharded over keys kept whole (a short
        context) run on this rank's query rows with no communication."""
        q, k, v = node.args[:3]
        sharded = sharded_inputs(node, placements)
        if not any(n in sharded for n in (q, k, v)) or any(p.dim != 2 for p in sharded.values()):
            return attention(node, placements, axis_size)
        masks = [n for n in node.all_input_nodes if n not in (q, k, v)]
        packed = any(isinstance(p, PackedShard) for p in sharded.values())
        _, _, causal = attention_options(node)
        if causal and (packed or (q in sharded) != (k in sharded) or shape_of(q)[2] != shape_of(k)[2]):
            raise Unshardable("causal attention over rows that are not in sequence order on this rank")
        # rows of a packed sequence arrive in rank order (permuted), whole or plainly sharded ones in order: one of
        # keys and values packed, the other's rows are put in the same order (collective_kernels); both packed,
        # they must be packed alike
        if placements.get(k) != placements.get(v) and all(isinstance(placements.get(n), PackedShard) for n in (k, v)):
            raise Unshardable("keys and values reach the exchange packed differently (q, k, v: "
                              f"{[str(placements.get(n, R)) for n in (q, k, v)]}); a packed sequence is exchanged "
                              "in rank order, so keys and values must be packed alike")
        if q in sharded and k not in sharded and v not in sharded:
            if shape_of(q)[2] < axis_size:
                raise Unshardable(f"{shape_of(q)[2]} query rows cannot be spread over a {axis} degree of "
                                  f"{axis_size}", node.name)
            return _query_rows(node, placements, masks)
        if any(n in sharded for n in masks):
            raise Unshardable("a mask sharded along the sequence (Ulysses needs it whole, per head)")
        info = annotation(node).heads
        where = info.module if info is not None else node.name
        heads, kv_heads = shape_of(q)[1], shape_of(k)[1]
        group = _gqa_group(node, heads, kv_heads)
        # Too few heads or rows for the degree: this attention is left whole (the planner records why). More
        # ranks than the heads a tp rank holds is correct but leaves ranks without heads.
        if kv_heads < axis_size:
            raise Unshardable(f"{kv_heads} {'key/value ' if group > 1 else ''}attention heads cannot be spread over "
                              f"a {axis} degree of {axis_size} (at most {kv_heads})", where)
        for n in (q, k):
            if n in sharded and shape_of(n)[2] < axis_size:
                raise Unshardable(f"a sequence of {shape_of(n)[2]} rows cannot be spread over a {axis} degree of "
                                  f"{axis_size}", where)
        # every rank takes whole groups of query heads with their key/value head (plain heads without GQA)
        by_heads = packed_shard(1, (heads,), group, axis_size)
        inputs = {q: by_heads, k: Shard(1), v: Shard(1)}
        inputs.update({mask: _along(mask, 1, group) for mask in masks})
        # Rows arrive in rank order: a packed (joint) sequence is permuted, the same way for keys and values, which
        # attention does not see (a mask is permuted alike by insert_collectives); the output goes back to the
        # queries' own layout by the inverse exchange, or is gathered whole when the queries were whole.
        return Decision(by_heads, inputs, visible=placements.get(q, R))
    return sequence_attention


def _gqa_group(node: Node, heads: int, kv_heads: int) -> int:
    """Query heads per key/value head: 1, or grouped-query attention's group (``enable_gqa``)."""
    if kv_heads == heads:
        return 1
    gqa = node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
    if not gqa or kv_heads == 0 or heads % kv_heads:
        raise Unshardable(f"{heads} query heads over {kv_heads} key/value heads without grouped-query attention")
    return heads // kv_heads


def _along(mask: Node, dim: int, unit: int = 1):
    """A mask broadcast against (batch, heads, q rows, k rows), cut along ``dim`` where it is not broadcast (over
    heads in whole groups of ``unit``, as the queries are)."""
    shape = shape_of(mask)
    local = dim - (4 - len(shape))
    return R if local < 0 or shape[local] == 1 else PackedShard(local, (shape[local],), unit) if unit > 1 \
        else Shard(local)


def _rows_like(mask: Node, rows):
    """A mask broadcast against (batch, heads, q rows, k rows), cut along its query rows as ``rows`` (the queries'
    placement along dim 2) cuts them, where it is not broadcast."""
    shape = shape_of(mask)
    local = 2 - (4 - len(shape))
    return R if local < 0 or shape[local] == 1 else with_dim(rows, local)


def _query_rows(node: Node, placements, masks: list[Node]) -> Decision:
    """Only the queries are sequence-sharded, keys and values whole (cross-attention to the text, or attention to
    a short context): every query row attends over every key on its own rank, so this rank's rows of the output
    need no communication; a mask is cut to the same query rows (a packed joint sequence's alike)."""
    q, k, v = node.args[:3]
    inputs = {q: placements[q], k: R, v: R}
    inputs.update({mask: _rows_like(mask, placements[q]) for mask in masks})
    return Decision(placements[q], inputs)
