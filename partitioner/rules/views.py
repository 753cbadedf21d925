"""Ops that move, pick or regroup dims without computing: views and reshapes, permutes, slices. A shard follows its
dim; an op that mixes the sharded dim with another, or cuts along it, is Unshardable (a slice into whole blocks of
a packed layout is that rank's part of them). Splits, cat, stack and pad are in ``joins``."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.fx import Node

from ..errors import PartitionError
from ..placement import PackedShard, block_offsets, is_sharded, packed_shard, unit_of
from .attention import RING_AXES
from .core import (Decision, NeedsPacking, NeedsUnit, R, Unshardable, norm_dim, register, register_factory,
                   same_as_input, shape_of, with_dim)
from ..annotations import annotation

aten = torch.ops.aten


def view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products (the dims a view merges or splits)."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi == pj and gi and gj:
                break
            if (pi <= pj and i < len(in_shape)) or j >= len(out_shape):
                if i >= len(in_shape):
                    break
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        # trailing size-1 dims join the last group
        while i < len(in_shape) and in_shape[i] == 1 and j >= len(out_shape):
            gi.append(i)
            i += 1
        while j < len(out_shape) and out_shape[j] == 1 and i >= len(in_shape):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def too_few_heads(node: Node, axis_size: int) -> None:
    """A head reshape or projection (annotated by annotate_heads) with fewer heads than ranks: a rank cannot hold
    none, so this attention stays whole (a degree above every attention's head count is refused by plan_sharding,
    ``degree_above_heads``)."""
    heads = annotation(node).heads
    if heads is not None and heads.heads < axis_size:
        raise Unshardable(f"{heads.module}: {heads.heads} attention heads cannot be spread over {axis_size} ranks")


def degree_above_heads(attentions, degree: int) -> PartitionError | None:
    """The error for a tp degree above the head count of every attention (``attentions``: annotate_heads'
    ``HeadInfo``s): tensor parallelism would shard none of them. It names the attention with the most heads, the
    largest degree that shards it, and meshes that give the other devices to another axis."""
    if not attentions or max(info.heads for info in attentions) >= degree:
        return None
    widest = max(attentions, key=lambda info: info.heads)
    return PartitionError(
        f"{widest.module}: {widest.heads} attention heads cannot be spread over a tp degree of {degree}; the largest "
        f"tp degree is {widest.heads}. Give the other devices to another axis instead, e.g. "
        f"{_alternatives(widest.heads, degree)}")


def _alternatives(heads: int, devices: int) -> str:
    tp = max(d for d in range(1, heads + 1) if devices % d == 0)
    return " or ".join(f"{{'tp': {tp}, '{axis}': {devices // tp}}}" for axis in ("ulysses", "ring", "dp"))


def view_placement(placement, in_shape, out_shape, axis_size: int, *, units: bool, source: Node | None = None,
                   groups: tuple[list[int], int, list[int]] | None = None):
    """The placement a view (reshape) of ``in_shape`` into ``out_shape`` gives a sharded input: Unshardable, or
    ``NeedsUnit`` (naming ``source``) when whole units would carry it. ``groups``: the input dims merged with the
    sharded one, the output dim taking its sharding and the output dims it splits into, when the op names them
    (unflatten, flatten); else read from the shapes."""
    group_in, lead_out, group_out = groups or _view_group(in_shape, out_shape, placement.dim)
    if _passes_through(in_shape, out_shape, placement.dim) and in_shape[placement.dim] == out_shape[lead_out]:
        return with_dim(placement, lead_out)
    return regroup(placement, source, in_shape, out_shape, group_in, lead_out, group_out, axis_size, units)


def _view_group(in_shape, out_shape, dim: int) -> tuple[list[int], int, list[int]]:
    """The input dims a view merges with ``dim`` (which must lead them), the output dim that takes its sharding,
    and the output dims it splits into."""
    for gi, gj in view_groups(in_shape, out_shape):
        if dim not in gi:
            continue
        lead_in = next(d for d in gi if in_shape[d] != 1) if any(in_shape[d] != 1 for d in gi) else gi[0]
        lead_out = next((d for d in gj if out_shape[d] != 1), gj[0] if gj else None)
        if dim != lead_in or lead_out is None:
            raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} mixes the sharded dim {dim} "
                              "with another dim")
        return gi, lead_out, gj
    raise Unshardable(f"dim {dim} not found in view {list(in_shape)} -> {list(out_shape)}")


def regroup(placement, source: Node, in_shape, out_shape, group_in, lead_out: int, group_out, axis_size: int,
            units: bool):
    """The placement a view gives a shard whose dim leads a group of input dims (``group_in``) that the view turns
    into ``group_out`` (its sharded dim ``lead_out``): heads merged into features, features split into heads.

    Rank boundaries fall at multiples of the shard's unit (of the whole shard when it splits evenly); in the
    flattened group that is a stride of ``unit * inner`` elements, ``inner`` being the dims after the sharded
    one. The output dim takes those boundaries only if they fall on whole rows of its own inner dims; else the
    producer must shard in coarser units (``NeedsUnit``: whole heads before a head split). Without ``units`` (the
    sequence axes, whose exchanges assume plain shards) only even splits regroup."""
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        return _one_block_per_lead_index(placement, source, in_shape, out_shape, group_in, lead_out, group_out,
                                         axis_size, units)
    dim, size = placement.dim, in_shape[placement.dim]
    unit = unit_of(placement)
    even = size // unit % axis_size == 0
    if even:
        unit = size // axis_size  # every boundary is a multiple of the whole shard
    inner_in = math.prod(in_shape[d] for d in group_in if d > dim)
    inner_out = math.prod(out_shape[d] for d in group_out if d > lead_out)
    stride = unit * inner_in
    if not units and not (even and stride % inner_out == 0 and out_shape[lead_out] % axis_size == 0):
        raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} regroups the sharded dim {dim}, "
                          f"whose size does not split evenly over {axis_size}")
    if stride % inner_out:
        needed = math.lcm(unit_of(placement), inner_out // math.gcd(inner_in, inner_out))
        raise NeedsUnit(source, needed)
    if out_shape[lead_out] // (stride // inner_out) < axis_size:
        raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} leaves {out_shape[lead_out]} rows of "
                          f"dim {lead_out} in {out_shape[lead_out] // (stride // inner_out)} pieces, fewer than "
                          f"the {axis_size} ranks")
    return packed_shard(lead_out, (out_shape[lead_out],), stride // inner_out, axis_size)


def _one_block_per_lead_index(placement: PackedShard, source: Node, in_shape, out_shape, group_in, lead_out: int,
                              group_out, axis_size: int, units: bool):
    """A packed value whose blocks are the indices of the view's leading output dim (a fused qkv projection packed
    as q, k, v, viewed ``[..., 3 * H * D] -> [..., 3, H, D]``): every block is split alike, so the shard lands on
    the dims after that one, as one block's would (its heads). Only over a tensor axis (``units``)."""
    blocks, lead = placement.blocks, out_shape[lead_out]
    rest = [d for d in group_out if d > lead_out and out_shape[d] != 1]
    if not units or len(set(blocks)) != 1 or len(blocks) != lead or not rest:
        raise Unshardable("a packed value cannot be reshaped along its packed dim")
    block_shape, one_index = list(in_shape), list(out_shape)
    block_shape[placement.dim], one_index[lead_out] = blocks[0], 1
    block = packed_shard(placement.dim, (blocks[0],), unit_of(placement), axis_size)
    return regroup(block, source, block_shape, one_index, group_in, rest[0], group_out, axis_size, units)


def packing_for_lead_dim(source: Node, dim: int) -> tuple[Node, tuple[int, ...]] | None:
    """Where ``dim`` of ``source`` leads the dims a view split one dim into (``[..., 3 * H * D]`` viewed
    ``[..., 3, H, D]``, perhaps permuted since: a fused qkv projection), that view's input and the equal blocks,
    one per index of ``dim``, it must be packed in for each index to be whole on every rank; else None."""
    node = source
    while node.target in (aten.permute.default, aten.transpose.int, aten.t.default):
        dim, node = permutation(node)[dim], node.args[0]
    if node.target not in _VIEWS or not isinstance(node.args[0], Node):
        return None
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    for group_in, group_out in view_groups(in_shape, out_shape):
        split = [d for d in group_in if in_shape[d] != 1]
        after = [d for d in group_out if out_shape[d] != 1]
        if dim in after and len(split) == 1 and after[0] == dim and len(after) > 1:
            return node.args[0], (in_shape[split[0]] // out_shape[dim],) * out_shape[dim]
    return None


def ask_for_packing(source: Node, dim: int, op: str) -> None:
    """Raise ``NeedsPacking`` for the view input found by ``packing_for_lead_dim``, else ``Unshardable``."""
    found = packing_for_lead_dim(source, dim)
    if found is not None:
        raise NeedsPacking(*found)
    raise Unshardable(f"{op} along the sharded dim {dim}")


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
          aten.flatten.using_ints)


@register(*_VIEWS)
def view(node: Node, placements, axis_size: int, units: bool = False, heads: bool | None = None) -> Decision:
    """A view, reshape, unflatten or flatten: the shard follows its dim (see ``regroup`` when the dim is merged
    with others or split). ``heads``: a head reshape must leave every rank a head (tp; by default with ``units``)."""
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement):
        return same_as_input(node, placements, source)
    in_shape, out_shape = shape_of(source), shape_of(node)
    sharded = placement.dim
    if node.target is aten.unflatten.int:
        dim = norm_dim(node.args[1], len(in_shape))
        count = len(node.args[2])
        if sharded != dim:
            return Decision(with_dim(placement, sharded + (count - 1) * (sharded > dim)), {source: placement})
        group_out = list(range(dim, dim + count))
        groups = [dim], next((d for d in group_out if out_shape[d] != 1), dim), group_out
    elif node.target is aten.flatten.using_ints:
        start, end = (norm_dim(d, len(in_shape)) for d in (list(node.args[1:3]) + [0, -1][len(node.args) - 1:]))
        if not start <= sharded <= end:
            return Decision(with_dim(placement, sharded - (end - start) * (sharded > end)), {source: placement})
        groups = list(range(start, end + 1)), start, [start]
        if any(in_shape[d] != 1 for d in range(start, sharded)):
            raise Unshardable(f"flatten({start}, {end}) mixes the sharded dim {sharded} with the dims before it")
    else:
        groups = None
    if units if heads is None else heads:
        too_few_heads(node, axis_size)
    return Decision(view_placement(placement, in_shape, out_shape, axis_size, units=units, source=source,
                                   groups=groups), {source: placement})


@register(*_VIEWS, axis="tensor")
def tensor_view(node: Node, placements, axis_size: int) -> Decision:
    """Over a tensor axis a view may split in whole units (a head reshape of features split by whole heads)."""
    return view(node, placements, axis_size, units=True)


def make_sequence_view(roles, axis: str):
    """Over a ring axis rows may regroup in whole units (an image's rows split unevenly, flattened with its width
    into an attention's sequence: each rank's rows are whole image rows); ring attention and gathers take any
    per-rank row counts. Ulysses' exchanges assume plain shards: only even splits regroup."""
    del roles
    units = axis in RING_AXES
    return lambda node, placements, axis_size: view(node, placements, axis_size, units=units, heads=False)


for _op in _VIEWS:
    register_factory(_op, axis="sequence")(make_sequence_view)


def _passes_through(in_shape, out_shape, dim: int) -> bool:
    """Input ``dim`` maps to one output dim of the same size, merged with nothing but size-1 dims."""
    for gi, gj in view_groups(in_shape, out_shape):
        if dim in gi:
            return [d for d in gi if in_shape[d] != 1] == [dim] and len([d for d in gj if out_shape[d] != 1]) == 1
    return False


def _moves_dims(new_dim: Callable[[Node, int], int]) -> Callable:
    """The rule of a single-input op that only moves dims around: the shard follows its dim to ``new_dim``."""
    def rule(node: Node, placements, axis_size: int) -> Decision:
        source = node.args[0]
        placement = placements.get(source, R)
        if not is_sharded(placement):
            return same_as_input(node, placements, source)
        return Decision(with_dim(placement, new_dim(node, placement.dim)), {source: placement})
    rule.__doc__ = new_dim.__doc__
    return rule


@register(aten.permute.default, aten.transpose.int, aten.t.default)
@_moves_dims
def permute(node: Node, dim: int) -> int:
    """permute / transpose / t"""
    return permutation(node).index(dim)


def permutation(node: Node) -> list[int]:
    """The input dim each output dim of a permute, transpose or t is."""
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.t.default:  # swaps the two dims of a matrix; a vector stays
        return [1, 0] if ndim == 2 else list(range(ndim))
    if node.target is aten.permute.default:
        return [norm_dim(d, ndim) for d in node.args[1]]
    a, b = (norm_dim(d, ndim) for d in node.args[1:3])
    order = list(range(ndim))
    order[a], order[b] = order[b], order[a]
    return order


@register(aten.unsqueeze.default)
@_moves_dims
def unsqueeze(node: Node, dim: int) -> int:
    return dim + (norm_dim(node.args[1], len(shape_of(node))) <= dim)


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
@_moves_dims
def squeeze(node: Node, dim: int) -> int:
    in_shape = shape_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [d for d, s in enumerate(in_shape) if s == 1]
    dims = [norm_dim(d, len(in_shape)) for d in ([dims] if isinstance(dims, int) else dims)]
    return dim - sum(d < dim and in_shape[d] == 1 for d in dims)


@register(aten.expand.default)
@_moves_dims
def expand(node: Node, dim: int) -> int:
    return dim + len(shape_of(node)) - len(shape_of(node.args[0]))


@register(aten.repeat.default)
@_moves_dims
def repeat(node: Node, dim: int) -> int:
    """repeat (tiling; leading repeats add dims): a sharded dim passes only where it is repeated once (grouped
    key/value heads tiled along a new dim of size 1); tiling it would interleave the ranks' rows."""
    new = len(node.args[1]) - len(shape_of(node.args[0]))
    if node.args[1][dim + new] != 1:
        raise Unshardable("repeat tiles the sharded dim")
    return dim + new


@register(aten.flip.default)
def flip(node: Node, placements, axis_size: int) -> Decision:
    """Reverses the order along ``dims``: a shard along any other dim stays where it is (reversing the sharded
    dim would move rows between ranks)."""
    source = node.args[0]
    placement = placements.get(source, R)
    if is_sharded(placement) and placement.dim in {norm_dim(d, len(shape_of(source))) for d in node.args[1]}:
        raise Unshardable(f"flip along the sharded dim {placement.dim}")
    return same_as_input(node, placements, source)


@register(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def slice_like(node: Node, placements, axis_size: int) -> Decision:
    """slice / select / index_select / narrow along a dim other than the sharded one."""
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement):
        return same_as_input(node, placements, source)
    ndim = len(shape_of(source))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    if dim == placement.dim:
        covered = block_range(node, placement) if isinstance(placement, PackedShard) and \
            node.target is aten.slice.Tensor else None
        if covered:  # whole blocks of a packed layout (the image rows of a joint sequence): this rank's part
            return Decision(blocks_placement(placement, *covered, axis_size), {source: placement})
        refined = _refined_blocks(node, placement) if node.target is aten.slice.Tensor else None
        if refined and splits_in_units(refined, unit_of(placement), axis_size):
            raise NeedsPacking(source, refined)  # a fused projection cut by slices: pack it at the cuts
        if node.target is aten.select.int and not isinstance(placement, PackedShard):
            ask_for_packing(source, dim, "select")  # (q = qkv[0] of a fused projection viewed into 3)
        raise Unshardable(f"{node.target.__name__} along the sharded dim {dim}")
    out_dim = placement.dim - (node.target is aten.select.int and dim < placement.dim)
    return Decision(with_dim(placement, out_dim), same_as_input(node, placements, source).inputs)


def slice_bounds(node: Node, size: int, dim_arg: int = 1) -> tuple[int, int] | None:
    """``[start, end)`` of a slice (or a slice_scatter, ``dim_arg`` 2) along a dim of ``size``, normalised; None
    for a step other than 1."""
    args = node.args
    start = args[dim_arg + 1] if len(args) > dim_arg + 1 and args[dim_arg + 1] is not None else 0
    end = args[dim_arg + 2] if len(args) > dim_arg + 2 and args[dim_arg + 2] is not None else size
    if (args[dim_arg + 3] if len(args) > dim_arg + 3 else 1) != 1:
        return None
    return (start + size if start < 0 else start), min(end + size if end < 0 else end, size)


def block_range(node: Node, placement: PackedShard, dim_arg: int = 1) -> tuple[int, int] | None:
    """The blocks ``[i, j)`` of ``placement`` that ``node`` (a slice, or a slice_scatter with ``dim_arg`` 2) covers
    exactly, with step 1; None when it cuts a block."""
    bounds = slice_bounds(node, sum(placement.blocks), dim_arg)
    offsets = block_offsets(placement.blocks)
    if bounds is None or bounds[0] not in offsets or bounds[1] not in offsets or bounds[1] <= bounds[0]:
        return None
    return offsets.index(bounds[0]), offsets.index(bounds[1])


def _refined_blocks(node: Node, placement) -> tuple[int, ...] | None:
    """The blocks that a slice (step 1) along the sharded dim would take whole: the layout's own boundaries and
    the slice's two ends (``x[..., :n]`` of a fused [gate; value] projection: blocks (n, n))."""
    size = shape_of(node.args[0])[placement.dim]
    bounds = slice_bounds(node, size)
    if bounds is None:
        return None
    layout = placement.blocks if isinstance(placement, PackedShard) else (size,)
    cuts = sorted(set(block_offsets(layout)) | set(bounds))
    refined = tuple(b - a for a, b in zip(cuts, cuts[1:]) if b > a)
    return refined if len(refined) > 1 else None


def blocks_placement(placement: PackedShard, i: int, j: int, axis_size: int):
    """Blocks ``[i, j)`` of a packed layout, in its units: a plain shard for one even block."""
    return packed_shard(placement.dim, placement.blocks[i:j], placement.unit, axis_size)


def splits_in_units(blocks, unit: int, axis_size: int) -> bool:
    """Every block is whole units, at least one per rank."""
    return all(block % unit == 0 and block // unit >= axis_size for block in blocks)


@register(aten.view_as_complex.default)
@_moves_dims
def view_as_complex(node: Node, dim: int) -> int:
    """(..., 2) reals -> (...) complex: the last dim is consumed (a shard there is refused by the caller's shape)."""
    if dim == len(shape_of(node.args[0])) - 1:
        raise Unshardable("view_as_complex over the sharded last dim")
    return dim


@register(aten.view_as_real.default)
@_moves_dims
def view_as_real(node: Node, dim: int) -> int:
    """(...) complex -> (..., 2) reals: a new last dim."""
    return dim


@register(aten.repeat_interleave.self_int)
def repeat_interleave(node: Node, placements, axis_size: int) -> Decision:
    """Each element repeated along one dim (``x.repeat_interleave(2, dim=-1)`` in rotary tables): fine along any
    other dim; without a dim the input is flattened first."""
    source = node.args[0]
    placement = placements.get(source, R)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not is_sharded(placement):
        return same_as_input(node, placements, source)
    if dim is None or norm_dim(dim, len(shape_of(source))) == placement.dim:
        raise Unshardable("repeat_interleave along (or flattening) the sharded dim")
    return Decision(placement, {source: placement})
