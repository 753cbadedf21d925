"""Ops that cut a value into pieces along a dim or join pieces along one: split, chunk, unbind, cat, stack, pad.
Along another dim a shard follows its dim. Along the sharded dim the pieces are the blocks of a packed layout
(``PackedShard``: a joint text + image sequence), each split as evenly as it can be over the ranks."""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from ..placement import InnerShard, PackedShard, Shard, block_offsets, is_sharded, packed_shard, unit_of
from .core import (Decision, NeedsPacking, NeedsUnit, R, Unshardable, norm_dim, register, replicate_all, same_as_input,
                   shape_of, sharded_inputs, with_dim)
from .views import ask_for_packing, blocks_placement, splits_in_units

aten = torch.ops.aten


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(node: Node, placements, axis_size: int) -> Decision:
    """pad / constant_pad_nd: fine along every dim but the sharded one. Constant rows added at one end of the
    sharded dim are one more block of a packed layout, each rank making its part of them (Mochi pads the joint
    attention's text rows back to the prompt's length): ``localize`` gives each rank its width."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement):
        return decision
    widths, ndim = node.args[1], len(shape_of(source))
    padded = {ndim - 1 - i // 2 for i, width in enumerate(widths) if width != 0}
    if placement.dim not in padded:
        return decision
    mode = node.args[2] if node.target is aten.pad.default and len(node.args) > 2 else "constant"
    before, after = widths[2 * (ndim - 1 - placement.dim)], widths[2 * (ndim - 1 - placement.dim) + 1]
    if mode != "constant" or isinstance(placement, InnerShard) or min(before, after) < 0 or before and after:
        raise Unshardable(f"pad along the sharded dim {placement.dim} (at both ends, cropping or not constant)")
    blocks = placement.blocks if isinstance(placement, PackedShard) else (shape_of(source)[placement.dim],)
    blocks, unit = (before, *blocks) if before else (*blocks, after), unit_of(placement)
    if not splits_in_units(blocks, unit, axis_size):  # (each rank pads its share of the new block: localize)
        raise Unshardable(f"pad along the sharded dim {placement.dim}: blocks {list(blocks)} are not whole units of "
                          f"{unit} for each of {axis_size} ranks")
    return Decision(packed_shard(placement.dim, blocks, unit, axis_size), decision.inputs)


@register(aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split(node: Node, placements, axis_size: int) -> Decision:
    """chunk / split / split_with_sizes / unbind. Splitting along the sharded dim needs a packed layout whose
    blocks are exactly the pieces: then each piece is a plain shard."""
    source = node.args[0]
    placement = placements.get(source, R)
    pieces = node.meta["val"]
    if not is_sharded(placement):
        return Decision(tuple(R for _ in pieces), same_as_input(node, placements, source).inputs)
    ndim = len(shape_of(source))
    if node.target is aten.unbind.int:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    else:
        dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
    if dim != placement.dim:
        out_dim = placement.dim - (node.target is aten.unbind.int and dim < placement.dim)
        return Decision(tuple(with_dim(placement, out_dim) for _ in pieces), {source: placement})
    if node.target is aten.unbind.int:
        if isinstance(placement, PackedShard):
            raise Unshardable(f"unbind along the sharded dim {dim}")
        ask_for_packing(source, dim, "unbind")  # (q, k, v = qkv.unbind(2) of a fused projection viewed into 3)
    blocks = tuple(int(p.shape[dim]) for p in pieces)
    offsets = block_offsets(placement.blocks) if isinstance(placement, PackedShard) else []
    cuts = block_offsets(blocks)
    if isinstance(placement, PackedShard) and set(cuts) <= set(offsets):
        # every piece is a run of whole blocks: its part of the layout (a fused qkv + MLP split, then each split)
        runs = [(offsets.index(a), offsets.index(b)) for a, b in zip(cuts, cuts[1:])]
        return Decision(tuple(blocks_placement(placement, i, j, axis_size) for i, j in runs), {source: placement})
    if not (isinstance(placement, PackedShard) and len(placement.blocks) > 1) and len(blocks) > 1 \
            and splits_in_units(blocks, unit_of(placement), axis_size):
        raise NeedsPacking(source, blocks)
    raise Unshardable(f"split into {list(blocks)} along the sharded dim {dim} ({placement})")


def _tensor_list_op(node: Node, placements) -> tuple[list[Node], int, dict[Node, object]]:
    """cat / stack: the tensors, the dim (normalised to the output's rank), the sharded inputs."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.args[0], norm_dim(dim, len(shape_of(node))), sharded_inputs(node, placements)


@register(aten.cat.default)
def cat(node: Node, placements, axis_size: int, units: bool = False) -> Decision:
    """cat along another dim keeps a common sharding; along the sharded dim, every piece sharded on its own (a
    joint text + image sequence) makes a packed layout whose blocks are the pieces (and a packed piece's blocks),
    each split as evenly as it can be (333 text rows over 2 ranks: 167 + 166), at least one row (or unit) per rank.
    Only tensor axes split in units (``units``): whole heads beside an MLP's rows."""
    tensors, dim, sharded = _tensor_list_op(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    if any(isinstance(p, PackedShard) for p in sharded.values()) and len(set(sharded.values())) == 1 \
            and next(iter(sharded.values())).dim != dim:
        if len(sharded) != len(tensors):
            raise Unshardable("cat of a packed value with values laid out otherwise")
        return Decision(next(iter(sharded.values())), {n: placements[n] for n in tensors})  # side by side
    dims = {p.dim for p in sharded.values()}
    if len(dims) != 1:
        raise Unshardable(f"cat of values sharded on different dims {sorted(dims)}")
    shard = dims.pop()
    if shard != dim:
        if any(isinstance(p, PackedShard) for p in sharded.values()):
            raise Unshardable("cat of values packed differently")
        return Decision(Shard(shard), {n: Shard(shard) for n in tensors})
    blocks, unit = (), math.lcm(*(unit_of(p) for p in sharded.values()))
    for n in tensors:
        placement = placements.get(n, R)
        blocks += placement.blocks if isinstance(placement, PackedShard) else (shape_of(n)[dim],)
    if not splits_in_units(blocks, unit, axis_size):
        raise Unshardable(f"cat along the sharded dim of blocks {list(blocks)}: not whole units of {unit} for "
                          f"each of {axis_size} ranks")
    inputs = {}
    for n in tensors:
        own = placements.get(n, R)
        inputs[n] = packed_shard(dim, own.blocks if isinstance(own, PackedShard) else (shape_of(n)[dim],), unit,
                                 axis_size)
        if n in sharded and own != inputs[n]:  # a piece split in finer units: its producer must use the common one
            raise NeedsUnit(n, unit)
    return Decision(packed_shard(dim, blocks, unit, axis_size), inputs)


@register(aten.cat.default, axis="tensor")
def tensor_cat(node: Node, placements, axis_size: int) -> Decision:
    """Over a tensor axis the pieces may split unevenly, in a common unit (whole heads beside an MLP's rows)."""
    return cat(node, placements, axis_size, units=True)


@register(aten.stack.default)
def stack(node: Node, placements, axis_size: int) -> Decision:
    tensors, dim, sharded = _tensor_list_op(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    if len(set(sharded.values())) != 1 or (len(sharded) != len(tensors)
                                           and any(isinstance(p, PackedShard) for p in sharded.values())):
        raise Unshardable("stack of values sharded differently")
    placement = next(iter(sharded.values()))
    return Decision(with_dim(placement, placement.dim + (dim <= placement.dim)), {n: placement for n in tensors})
