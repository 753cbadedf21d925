"""Ops that pick or write rows by index: index_select, index_copy, and the scatters functionalization makes of
slice assignment (``x[..., a:b] = y`` becomes slice_scatter)."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..placement import PackedShard, Shard, is_sharded, packed_shard, unit_of
from .core import Decision, R, Unshardable, norm_dim, register, shape_of, with_dim
from .pointwise import pointwise_on
from .views import block_range, blocks_placement, slice_bounds, slice_like, splits_in_units

aten = torch.ops.aten


@register(aten.index_select.default)
def index_select(node: Node, placements, axis_size: int) -> Decision:
    """Rows picked by an index: a sharded index picks this rank's rows of a replicated table, locally (H3's
    per-row AdaLN parameters under sequence parallelism)."""
    source, dim, index = node.args[:3]
    if is_sharded(placements.get(index, R)):
        if is_sharded(placements.get(source, R)):
            raise Unshardable("index_select with both the table and the index sharded")
        return Decision(Shard(norm_dim(dim, len(shape_of(source)))), {source: R, index: placements[index]})
    return slice_like(node, placements, axis_size)



@register(aten.index.Tensor)
def index_tensor(node: Node, placements, axis_size: int) -> Decision:
    """``x[:, :, rows]`` with one 1-D index tensor (Mochi's valid text rows): index_select along its dim. Several
    or multi-dim index tensors reshape the result and are left whole."""
    source, indices = node.args[:2]
    picked = [(dim, index) for dim, index in enumerate(indices) if index is not None]
    sharded = {n: placements[n] for n in node.all_input_nodes if is_sharded(placements.get(n, R))}
    if not sharded:
        return Decision(R, {n: R for n in node.all_input_nodes})
    if len(picked) != 1 or len(shape_of(picked[0][1])) != 1 or \
            picked[0][1].meta["val"].dtype in (torch.bool, torch.uint8):
        raise Unshardable("advanced indexing with several, multi-dim or boolean index tensors")
    (dim, index), placement = picked[0], sharded.get(source)
    if index in sharded:
        if placement is not None or type(sharded[index]) is not Shard:
            raise Unshardable("indexing with both the table and the index sharded")
        return Decision(Shard(dim), {source: R, index: sharded[index]})
    if placement.dim == dim:
        raise Unshardable("indexing along the sharded dim")
    return Decision(placement, {source: placement, index: R})


@register(aten.embedding.default)
def embedding(node: Node, placements, axis_size: int) -> Decision:
    """embedding(table, indices): one row of the table per index, ``out[..., :] = table[indices[...], :]``. Indices
    split any way (rows of a sequence: a condition-type id per text row) pick their rows of a whole table; a table
    split along its features gives those features of every row. A table split by rows would need every index's row
    on every rank: left whole."""
    table, indices = node.args[:2]
    split_table, split_indices = (placements.get(n, R) for n in (table, indices))
    if is_sharded(split_table) and is_sharded(split_indices):
        raise Unshardable("embedding with both the table and the indices sharded")
    if is_sharded(split_indices):
        return Decision(split_indices, {table: R, indices: split_indices})
    if is_sharded(split_table):
        if not isinstance(split_table, Shard) or split_table.dim != 1:
            raise Unshardable("embedding from a table split by rows (each index may need any row)")
        return Decision(Shard(len(shape_of(node)) - 1), {table: split_table, indices: R})
    return Decision(R, {table: R, indices: R})


@register(aten.gather.default)
def gather(node: Node, placements, axis_size: int) -> Decision:
    """gather(input, dim, index): ``out[..., i, ...] = input[..., index[..., i, ...], ...]`` along ``dim``, and
    position for position along every other dim. Rows of the index split along ``dim`` read any row of the input,
    which stays whole (rotary tables gathered by per-token positions); along another dim the index and the input
    are split alike, which needs them of one size there."""
    source, dim, index = node.args[:3]
    dim = norm_dim(dim, len(shape_of(node)))
    sharded = {n: placements[n] for n in (source, index) if is_sharded(placements.get(n, R))}
    if not sharded:
        return Decision(R, {source: R, index: R})
    if len(set(sharded.values())) != 1 or not all(isinstance(p, Shard) for p in sharded.values()):
        raise Unshardable("gather with its input and index sharded differently")
    out = next(iter(sharded.values()))
    if out.dim == dim:
        if source in sharded:
            raise Unshardable("gather from an input sharded along the gathered dim")
        return Decision(out, {source: R, index: out})
    if shape_of(source)[out.dim] != shape_of(index)[out.dim]:
        raise Unshardable(f"gather's input and index differ in size along the sharded dim {out.dim}")
    return Decision(out, {source: out, index: out})


@register(aten.index_copy.default)
def index_copy(node: Node, placements, axis_size: int) -> Decision:
    target, dim, index, source = node.args[:4]
    ndim = len(shape_of(node))
    dim = norm_dim(dim, ndim)
    decision = pointwise_on(node, placements, (target, source))
    if is_sharded(decision.output) and decision.output.dim == dim:
        raise Unshardable("index_copy along the sharded dim")
    decision.inputs[index] = R
    return decision



def _scatter_into_blocks(node: Node, placements, dim: int, axis_size: int) -> Decision:
    """slice_scatter into whole blocks of a packed layout (a joint sequence whose image rows get their rotary
    embedding in place: ``q[:, :, text:] = rotate(q[:, :, text:])``): each rank writes its part of those blocks."""
    target, src = node.args[0], node.args[1]
    placement = placements.get(target, R)
    covered = block_range(node, placement, dim_arg=2) if node.target is aten.slice_scatter.default and \
        isinstance(placement, PackedShard) and placement.dim == dim else None
    if covered is None or placements.get(src, R) != blocks_placement(placement, *covered, axis_size):
        raise Unshardable(f"{node.target.__name__} of a packed value, not into whole blocks laid out alike")
    return Decision(placement, {target: placement, src: placements[src]})


def _packed_around(node: Node, src_placement, dim: int, axis_size: int):
    """The packed layout a whole buffer takes when a value sharded along ``dim`` is written into rows
    ``[start, end)`` of it (a joint sequence assembled in place, ``joint[:, text:] = image``): the rows before, the
    written ones (in their own blocks) and the rows after, each block split as evenly as it can be, so every rank
    writes its part."""
    size = shape_of(node)[dim]
    bounds = slice_bounds(node, size, dim_arg=2)
    if bounds is None:
        raise Unshardable("slice_scatter with a step along the sharded dim")
    start, end = bounds
    written = src_placement.blocks if isinstance(src_placement, PackedShard) else (end - start,)
    blocks, unit = tuple(b for b in (start, *written, size - end) if b), unit_of(src_placement)
    if not splits_in_units(blocks, unit, axis_size):  # (each rank writes its share of every block: localize)
        raise Unshardable(f"slice_scatter along the sharded dim {dim}: blocks {list(blocks)} are not whole units "
                          f"of {unit} for each of {axis_size} ranks")
    return packed_shard(dim, blocks, unit, axis_size)


@register(aten.slice_scatter.default, aten.select_scatter.default)
def scatter_into(node: Node, placements, axis_size: int) -> Decision:
    """slice_scatter / select_scatter (what functionalization makes of ``x[..., a:b] = y``): ``src`` is written
    into a slice of ``self`` along ``dim``. Along any other dim the two are sharded alike, row for row. Along the
    sharded dim a sharded ``src`` fills whole blocks of a packed ``self``; a whole ``self`` (a buffer of zeros) is
    laid out packed around it, sliced for free."""
    target, src, dim = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 0
    dim = norm_dim(dim, len(shape_of(node)))
    selected = node.target is aten.select_scatter.default  # src lacks ``dim``
    sharded = {n: placements[n] for n in (target, src) if is_sharded(placements.get(n, R))}
    if not sharded:
        return Decision(R, {n: R for n in node.all_input_nodes})
    as_output = dict(sharded)  # each sharded input's placement in the output's dims
    if src in sharded and selected:
        as_output[src] = with_dim(sharded[src], sharded[src].dim + (sharded[src].dim >= dim))
    if {p.dim for p in as_output.values()} == {dim}:  # written along the sharded dim
        if selected:
            raise Unshardable(f"select_scatter along the sharded dim {dim}")
        if target not in sharded:
            around = _packed_around(node, sharded[src], dim, axis_size)
            if not isinstance(around, PackedShard):  # src replaces all of self
                return Decision(around, {target: around, src: sharded[src]})
            placements = {**placements, target: around}
        return _scatter_into_blocks(node, placements, dim, axis_size)
    if len(set(as_output.values())) != 1:
        raise Unshardable(f"{node.target.__name__} of values sharded differently: "
                          f"{sorted(map(str, set(as_output.values())))}")
    out = next(iter(as_output.values()))
    inputs = {n: R for n in node.all_input_nodes}
    inputs.update({target: out, src: with_dim(out, out.dim - (selected and out.dim > dim))})
    return Decision(out, inputs)
