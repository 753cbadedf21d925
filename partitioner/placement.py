"""Placements of graph values: DTensor's vocabulary plus one packed variant.

A value's placement says how the per-rank tensor relates to the global one along one mesh axis:

- ``Replicate()``: every rank holds the whole tensor.
- ``Shard(dim)``: rank ``r`` of ``n`` holds the ``r``-th of ``n`` equal slices along ``dim``.
- ``Partial()``: every rank holds a summand; the global value is the sum over the axis.
- ``PackedShard(dim, blocks)``: ``dim`` is the concatenation of blocks of the given global sizes (a fused
  ``[value; gate]`` projection, or ``cat([attn, mlp])``); each block is sharded on its own and rank ``r`` holds the
  concatenation of its slices of every block. With one block it is exactly ``Shard(dim)``.

Placements are stored per mesh axis name in ``node.meta["placements"]`` (a ``dict[str, Placement]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .errors import PartitionError

__all__ = ["Partial", "PackedShard", "Placement", "Replicate", "Shard", "local_shape", "shard_slices", "shorthand"]


@dataclass(frozen=True)
class PackedShard:
    dim: int
    blocks: tuple[int, ...]

    def __repr__(self) -> str:
        return f"PackedShard({self.dim}, {list(self.blocks)})"


def is_sharded(placement) -> bool:
    return isinstance(placement, (Shard, PackedShard))


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
    """The ``[start, end)`` ranges of a dimension of ``size`` that rank ``index`` of ``num`` holds. A plain shard
    may be uneven; each block of a packed shard must split evenly (it is a weight's fused halves)."""
    if not isinstance(placement, PackedShard):
        return [shard_range(size, num, index)]
    if sum(placement.blocks) != size:
        raise PartitionError(f"packed blocks {list(placement.blocks)} do not add up to the dimension size {size}")
    ranges, offset = [], 0
    for block in placement.blocks:
        if block % num:
            raise PartitionError(f"a block of size {block} does not split evenly over {num} ranks")
        step = block // num
        ranges.append((offset + index * step, offset + (index + 1) * step))
        offset += block
    return ranges


def local_shape(shape, placements: dict, mesh, upto: str | None = None) -> list[int]:
    """This rank's shape of a value of global ``shape`` under ``placements`` (axis name -> placement).

    Axes apply in mesh order: a dim sharded over two axes is split by the outer axis, then the outer shard by the
    inner axis (DTensor's convention). With ``upto``, only the axes before that one apply: the size the ``upto``
    axis itself splits."""
    out = list(shape)
    for axis in mesh.axis_names:
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
    """Compact form used in dumps: R, S(2), P, S(2)[96,96]."""
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, PackedShard):
        return f"S({placement.dim}){list(placement.blocks)}"
    return str(placement)
