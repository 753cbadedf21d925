"""Placements of graph values: DTensor's vocabulary plus one packed variant.

A value's placement says how the per-rank tensor relates to the global one along one mesh axis:

- ``Replicate()``: every rank holds the whole tensor.
- ``Shard(dim)``: rank ``r`` of ``n`` holds the ``r``-th of ``n`` equal slices along ``dim``.
- ``Partial()``: every rank holds a summand; the global value is the sum over the axis.
- ``PackedShard(dim, blocks, unit)``: ``dim`` is the concatenation of blocks of the given global sizes (a fused
  ``[value; gate]`` projection, or ``cat([attn, mlp])``); each block is sharded on its own, in whole ``unit``s (a
  head's ``head_dim`` features, so that heads split whole), and rank ``r`` holds the concatenation of its slices of
  every block. With one block and ``unit`` 1 it is exactly ``Shard(dim)``; ``packed_shard`` builds the simplest
  form.

- ``InnerShard(dim)``: ``Shard(dim)`` split last, inside every other axis's shard of ``dim`` instead of in mesh
  order: tp's rows within a ulysses (or ring) shard of the sequence (``plan_tp_sequence``), so that gathering them
  over tp gives that shard back. Only the passes that build a rank's program meet it; the planning rules never do.

Shards need not be even: ``n`` ranks split ``k`` units as ``shard_sizes`` says, the first ``k % n`` ranks one unit
larger (56 heads over 16 ranks: 8 ranks with 4 heads, 8 with 3).

Placements are stored per mesh axis name in a node's annotation (``annotations.annotation(node).placements``, a
``dict[str, Placement]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .errors import PartitionError

__all__ = ["InnerShard", "Partial", "PackedShard", "Placement", "Replicate", "Shard", "block_offsets", "boundary_unit",
           "local_shape",
           "packed_shard", "shard_slices", "shard_widths", "shorthand", "split_order", "unit_of"]


@dataclass(frozen=True)
class PackedShard:
    dim: int
    blocks: tuple[int, ...]
    unit: int = 1  # each block splits into whole units of this many elements

    def __repr__(self) -> str:
        unit = f", unit={self.unit}" if self.unit != 1 else ""
        return f"PackedShard({self.dim}, {list(self.blocks)}{unit})"


@dataclass(frozen=True)
class InnerShard:
    dim: int

    def __repr__(self) -> str:
        return f"InnerShard({self.dim})"


def packed_shard(dim: int, blocks, unit: int, num: int):
    """The simplest placement that splits ``dim`` (blocks of the given sizes, each in whole ``unit``s) over ``num``
    ranks: the unit is dropped when every block splits evenly anyway, and one block of unit 1 is a plain shard."""
    blocks = tuple(blocks)
    if any(block % unit for block in blocks):
        raise PartitionError(f"blocks {list(blocks)} are not whole units of {unit}")
    if all(block // unit % num == 0 for block in blocks):
        unit = 1
    return Shard(dim) if len(blocks) == 1 and unit == 1 else PackedShard(dim, blocks, unit)


def block_offsets(blocks) -> list[int]:
    """Where each block of a packed dim starts, and the dim's end: (8, 16) -> [0, 8, 24]."""
    return [sum(blocks[:i]) for i in range(len(blocks) + 1)]


def unit_of(placement) -> int:
    """The granule a shard splits in (1 for a plain shard)."""
    return placement.unit if isinstance(placement, PackedShard) else 1


def is_sharded(placement) -> bool:
    return isinstance(placement, (Shard, PackedShard, InnerShard))


def any_sharded(placement) -> bool:
    """True for a sharded placement, or a tuple of placements (multi-output op) with a sharded member."""
    if isinstance(placement, tuple):
        return any(map(is_sharded, placement))
    return is_sharded(placement)


def shard_sizes(size: int, num: int) -> list[int]:
    """How ``size`` rows split over ``num`` ranks: as evenly as possible, the first ranks one larger
    (7 heads over 4 ranks: 2, 2, 2, 1). Even splits are the plain ``size // num``."""
    return [size // num + (index < size % num) for index in range(num)]


def shard_range(size: int, num: int, index: int) -> tuple[int, int]:
    sizes = shard_sizes(size, num)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def shard_slices(placement, size: int, num: int, index: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a dimension of ``size`` that rank ``index`` of ``num`` holds: one range of
    a plain shard, one per block of a packed shard (each block split in whole units, as evenly as can be)."""
    if not isinstance(placement, PackedShard):
        return [shard_range(size, num, index)]
    if sum(placement.blocks) != size:
        raise PartitionError(f"packed blocks {list(placement.blocks)} do not add up to the dimension size {size}")
    ranges, offset, unit = [], 0, placement.unit
    for block in placement.blocks:
        if block % unit:
            raise PartitionError(f"a block of size {block} is not whole units of {unit}")
        start, end = shard_range(block // unit, num, index)
        ranges.append((offset + start * unit, offset + end * unit))
        offset += block
    return ranges


def delivery_order(placement, size: int, num: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a dim of ``size`` in the order a gather or a packed exchange over ``num``
    ranks delivers them: rank by rank, each rank's ranges (its part of every block of a packed shard) in turn."""
    return [piece for index in range(num) for piece in shard_slices(placement, size, num, index)]


def boundary_unit(placement, size: int, num: int) -> int:
    """The granule every rank's part of a dim of ``size`` starts at a multiple of: a packed shard's unit, the whole
    share of a plain shard that splits evenly, else 1 (a strided convolution or space-to-depth needs it to be a
    multiple of its stride)."""
    if isinstance(placement, PackedShard):
        return placement.unit
    return size // num if size % num == 0 else 1


def shard_widths(placement, size: int, num: int) -> list[int]:
    """How many elements of a dim of ``size`` each of ``num`` ranks holds."""
    return [sum(end - start for start, end in shard_slices(placement, size, num, index)) for index in range(num)]


def split_order(placements: dict, mesh) -> list[str]:
    """The order in which the mesh axes split a value: mesh order, ``InnerShard`` axes last."""
    inner = [axis for axis in mesh.axis_names if isinstance(placements.get(axis), InnerShard)]
    return [axis for axis in mesh.axis_names if axis not in inner] + inner


def local_shape(shape, placements: dict, mesh, upto: str | None = None) -> list[int]:
    """This rank's shape of a value of global ``shape`` under ``placements`` (axis name -> placement).

    Axes apply in mesh order: a dim sharded over two axes is split by the outer axis, then the outer shard by the
    inner axis (DTensor's convention); an ``InnerShard`` splits after every other axis. With ``upto``, only the
    axes that apply before that one do: the size the ``upto`` axis itself splits."""
    out = list(shape)
    for axis in split_order(placements, mesh):
        if axis == upto:
            break
        placement = placements.get(axis)
        if is_sharded(placement):
            ranges = shard_slices(placement, out[placement.dim], mesh.size(axis), mesh.coordinate(axis))
            out[placement.dim] = sum(end - start for start, end in ranges)
    return out


def slice_local(tensor: torch.Tensor, placement, num: int, index: int) -> torch.Tensor:
    """This rank's part of a full tensor (a copy, so that the full tensor can be freed)."""
    if not is_sharded(placement):
        return tensor
    pieces = [tensor.narrow(placement.dim, start, end - start)
              for start, end in shard_slices(placement, tensor.shape[placement.dim], num, index)]
    return torch.cat(pieces, dim=placement.dim) if len(pieces) > 1 else pieces[0].clone()


def shorthand(placement) -> str:
    """Compact form used in dumps: R, S(2), P, S(2)[96,96], S(2)[7168]/128 (in whole units of 128), S(1)in (inner)."""
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, PackedShard):
        unit = f"/{placement.unit}" if placement.unit != 1 else ""
        return f"S({placement.dim}){list(placement.blocks)}{unit}"
    if isinstance(placement, InnerShard):
        return f"S({placement.dim})in"
    return str(placement)
