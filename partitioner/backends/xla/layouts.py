"""How a planned value is laid out on XLA's devices: the partition spec of its placements, and the two layouts that
differ from the plan's global one because XLA's equal tiles cannot express what a rank holds (``Packed``, rank-major
blocks; ``Nested``, uneven shards padded to equal tiles)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...placement import PackedShard, Partial, Replicate, Shard
from .errors import XlaBackendError
from ...annotations import annotation


def partition_spec(placements: dict, ndim: int, mesh_axes: tuple[str, ...]) -> tuple | None:
    """The torch_xla partition spec of a value placed as ``placements`` (axis -> placement), or None when XLA
    cannot express it (Partial, or a packed shard of the fused dim)."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis in mesh_axes:
        placement = placements.get(axis, Replicate())
        if isinstance(placement, PackedShard) and len(placement.blocks) == 1:
            placement = Shard(placement.dim)  # whole units, unevenly: XLA's padded equal tiles (see ``uneven``)
        if isinstance(placement, (Partial, PackedShard, tuple)):
            return None
        if isinstance(placement, Shard):
            dims[placement.dim % ndim].append(axis)
    return tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims)


def packed_spec(placements: dict, ndim: int, mesh_axes: tuple[str, ...]) -> tuple | None:
    """The spec of a packed value in its rank-major layout (one more dim than the value, see ``Packed``): the
    packed axis shards the new rank dim, the other axes keep their dims (shifted past it)."""
    fused = _packed_placement(placements).dim % ndim
    moved = {}
    for axis, placement in placements.items():
        if isinstance(placement, PackedShard):
            moved[axis] = Shard(fused)
        elif isinstance(placement, Shard) and placement.dim % ndim > fused:
            moved[axis] = Shard(placement.dim % ndim + 1)
        else:
            moved[axis] = placement
    return partition_spec(moved, ndim + 1, mesh_axes)


@dataclass
class Packed:
    """A value of a ``PackedShard`` placement in its rank-major layout: the packed dim ``dim`` of global size
    ``sum(blocks)`` is held as ``[ranks, sum(blocks) // ranks]``, rank ``r`` holding its slice of every block, in
    block order. Sharded on the rank dim, this is exactly what each rank holds, so XLA needs no data movement for a
    Linear that makes it or consumes it (one contraction, one all-reduce), nor for splitting it into blocks."""
    tensor: torch.Tensor
    dim: int
    blocks: tuple[int, ...]

    @staticmethod
    def from_blocks(tensors, dim: int, ranks: int) -> "Packed":
        pieces = [t.unflatten(dim, (ranks, t.shape[dim] // ranks)) for t in tensors]
        return Packed(torch.cat(pieces, dim + 1), dim, tuple(t.shape[dim] for t in tensors))

    @property
    def ranks(self) -> int:
        return self.tensor.shape[self.dim]

    def split(self) -> tuple[torch.Tensor, ...]:
        """The blocks, each sharded on ``dim``: a slice of the unsharded dim, then a merge of the rank dim."""
        pieces = self.tensor.split([size // self.ranks for size in self.blocks], self.dim + 1)
        return tuple(piece.flatten(self.dim, self.dim + 1) for piece in pieces)

    def fused(self) -> torch.Tensor:
        """The value in its global layout (XLA moves data to build it: only where the plan has no packed rule)."""
        return torch.cat(self.split(), self.dim)


def _packed_placement(placements: dict, mesh=None) -> PackedShard | None:
    """The placement a value is laid out rank-major for: a packed shard of several blocks, each split evenly (over
    its axis of ``mesh``, when given). An uneven one is left to XLA's padded tiles (see ``uneven_splits``)."""
    packed = [p for axis, p in placements.items() if isinstance(p, PackedShard) and len(p.blocks) > 1
              and (mesh is None or not _uneven(p, mesh.size(axis)))]
    if len(packed) > 1:
        raise XlaBackendError(f"a value packed over several mesh axes ({placements}) is not supported")
    return packed[0] if packed else None


def _uneven(placement, ranks: int) -> bool:
    return isinstance(placement, PackedShard) and any(block // placement.unit % ranks for block in placement.blocks)


def uneven_splits(gm, mesh) -> list[str]:
    """Values the plan splits unevenly in whole units (heads that do not divide the tp degree). XLA tiles a dim in
    equal, padded pieces, so around these values its partitioner moves data the plan does not (all-gathers and
    collective-permutes at head reshapes): exact, but not the plan's collectives."""
    return [node.name for node in gm.graph.nodes
            for axis, p in (annotation(node).placements or {}).items()
            if not isinstance(p, tuple) and _uneven(p, mesh.size(axis))]


def _packed_ranks(placements: dict, mesh) -> int:
    """How many ranks the packed axis has: the rank dim of the layout."""
    return next(mesh.size(axis) for axis, p in placements.items() if isinstance(p, PackedShard))


@dataclass
class Nested:
    """A value whose dim ``dim`` the plan shards over two axes, ``outer`` shards first, each then split over the
    inner axis unevenly (tiny H3 at TP=2 x Ulysses=2 with 6 heads: 3 per tp rank, 2 + 1 over ulysses; H3 at TP=8 x
    Ulysses=8: 7 over 8). XLA tiles a dim in equal tiles, so no sharding of the dim keeps the tp shards whole. Each
    outer shard is padded with zeros to a multiple of the inner degree instead: equal tiles then fall exactly as the
    plan splits. Attention runs on the padded heads (zeros in, zeros out), and the pad is dropped once the inner
    axis no longer shards the dim."""
    tensor: torch.Tensor
    dim: int
    outer: int
    local: int  # real entries per outer shard

    @staticmethod
    def pad(tensor: torch.Tensor, dim: int, outer: int, inner: int) -> "Nested":
        local = tensor.shape[dim] // outer
        blocks = tensor.unflatten(dim, (outer, local))
        shape = list(blocks.shape)
        shape[dim + 1] = -local % inner
        padded = torch.cat([blocks, blocks.new_zeros(shape)], dim + 1)
        return Nested(padded.flatten(dim, dim + 1), dim, outer, local)

    def unpad(self) -> torch.Tensor:
        blocks = self.tensor.unflatten(self.dim, (self.outer, -1))
        return blocks.narrow(self.dim + 1, 0, self.local).flatten(self.dim, self.dim + 1)


def nested_uneven(placements: dict, shape, mesh) -> tuple[int, int, int] | None:
    """(dim, outer size, inner size) where ``placements`` shard a dim over two axes and the outer shards do not
    split evenly over the inner axis; None if there is no such dim."""
    for dim, size in enumerate(shape):
        axes = [axis for axis in mesh.axis_names
                if isinstance(placements.get(axis), Shard) and placements[axis].dim % len(shape) == dim]
        if len(axes) == 2:
            outer, inner = mesh.size(axes[0]), mesh.size(axes[1])
            if size % outer == 0 and size // outer % inner:
                return dim, outer, inner
    return None


def _fused(value):
    if isinstance(value, Packed):
        return value.fused()
    return value.unpad() if isinstance(value, Nested) else value
