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


def shard_slices(placement, size: int, num: int, index: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a dimension of global ``size`` that rank ``index`` of ``num`` holds."""
    blocks = placement.blocks if isinstance(placement, PackedShard) else (size,)
    if sum(blocks) != size:
        raise ValueError(f"packed blocks {list(blocks)} do not add up to the dimension size {size}")
    ranges, offset = [], 0
    for block in blocks:
        if block % num:
            raise ValueError(f"a block of size {block} does not split evenly over {num} ranks")
        step = block // num
        ranges.append((offset + index * step, offset + (index + 1) * step))
        offset += block
    return ranges


def local_shape(shape, placements: dict, axis_sizes: dict[str, int]) -> list[int]:
    """Per-rank shape of a value of global ``shape`` under ``placements`` (axis name -> placement)."""
    out = list(shape)
    for axis, placement in placements.items():
        if is_sharded(placement):
            out[placement.dim] //= axis_sizes[axis]
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
