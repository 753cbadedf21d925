"""Ops that move, pick or regroup dims without computing: views and reshapes, permutes, slices, splits, cat and
stack. A shard follows its dim; an op that mixes the sharded dim with another, or cuts along it, is Unshardable
(a split along it asks for a packed layout instead)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from ..errors import PartitionError
from ..placement import PackedShard, Shard, is_sharded
from .core import (R, Decision, NeedsPacking, Unshardable, norm_dim, register, replicate_all, same_as_input, shape_of,
                   sharded_inputs, with_dim)

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


def heads_do_not_split(node: Node, axis_size: int) -> None:
    """A head reshape or projection (annotated by annotate_heads) that does not split evenly is a user error:
    tensor parallelism needs whole heads on every rank."""
    heads = node.meta.get("heads")
    if heads is not None:
        raise PartitionError(f"{heads.module}: {heads.heads} attention heads cannot be split evenly over a tp "
                             f"degree of {axis_size}; use a degree that divides {heads.heads}")


def view_shard_dim(in_shape, out_shape, dim: int, axis_size: int) -> int:
    """The output dim a view carries input dim ``dim``'s sharding to, or Unshardable."""
    for gi, gj in view_groups(in_shape, out_shape):
        if dim not in gi:
            continue
        lead_in = next(d for d in gi if in_shape[d] != 1) if any(in_shape[d] != 1 for d in gi) else gi[0]
        lead_out = next((d for d in gj if out_shape[d] != 1), gj[0] if gj else None)
        if dim != lead_in or lead_out is None:
            raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} mixes the sharded dim {dim} "
                              "with another dim")
        # a dim passed through unchanged may split unevenly; one merged or split with others must split evenly
        passthrough = [d for d in gi if in_shape[d] != 1] == [dim] and in_shape[dim] == out_shape[lead_out] \
            and [d for d in gj if out_shape[d] != 1] == [lead_out]
        if not passthrough and (in_shape[dim] % axis_size or out_shape[lead_out] % axis_size):
            raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} regroups the sharded dim {dim}, "
                              f"whose size does not split evenly over {axis_size}")
        return lead_out
    raise Unshardable(f"dim {dim} not found in view {list(in_shape)} -> {list(out_shape)}")


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
          aten.flatten.using_ints)
def view(node: Node, placements, axis_size: int) -> Decision:
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement):
        return same_as_input(node, placements, source)
    in_shape, out_shape = shape_of(source), shape_of(node)
    if node.target is aten.unflatten.int:
        dim = norm_dim(node.args[1], len(in_shape))
        count = len(node.args[2])
        if placement.dim < dim:
            out_dim = placement.dim
        elif placement.dim > dim:
            out_dim = placement.dim + count - 1
        else:
            out_dim = dim
            if out_shape[dim] % axis_size:
                heads_do_not_split(node, axis_size)
                raise Unshardable(f"unflatten to {list(out_shape)} does not split over {axis_size} ranks")
    elif node.target is aten.flatten.using_ints:
        start, end = (norm_dim(d, len(in_shape)) for d in (list(node.args[1:3]) + [0, -1][len(node.args) - 1:]))
        if placement.dim < start:
            out_dim = placement.dim
        elif placement.dim > end:
            out_dim = placement.dim - (end - start)
        elif placement.dim == start and (end == start or in_shape[start] % axis_size == 0):
            out_dim = start
        else:
            raise Unshardable(f"flatten({start}, {end}) mixes the sharded dim {placement.dim}")
    else:
        out_dim = view_shard_dim(in_shape, out_shape, placement.dim, axis_size)
    if isinstance(placement, PackedShard):  # its blocks survive only a dim passed through whole
        if in_shape[placement.dim] != out_shape[out_dim] or not _passes_through(in_shape, out_shape, placement.dim):
            raise Unshardable("a packed value cannot be reshaped along its packed dim")
        return Decision(PackedShard(out_dim, placement.blocks), {source: placement})
    return Decision(Shard(out_dim), {source: placement})


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


@register(aten.permute.default, aten.transpose.int)
@_moves_dims
def permute(node: Node, dim: int) -> int:
    """permute / transpose"""
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.permute.default:
        order = [norm_dim(d, ndim) for d in node.args[1]]
    else:
        a, b = (norm_dim(d, ndim) for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    return order.index(dim)


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
            return Decision(blocks_placement(placement, *covered), {source: placement})
        refined = _refined_blocks(node, placement) if node.target is aten.slice.Tensor else None
        if refined and all(block % axis_size == 0 for block in refined):
            raise NeedsPacking(source, refined)  # a fused projection cut by slices: pack it at the cuts
        raise Unshardable(f"{node.target.__name__} along the sharded dim {dim}")
    out_dim = placement.dim - (node.target is aten.select.int and dim < placement.dim)
    return Decision(with_dim(placement, out_dim), same_as_input(node, placements, source).inputs)



def _slice_bounds(node: Node, size: int, dim_arg: int = 1) -> tuple[int, int] | None:
    """``[start, end)`` of a slice (or a slice_scatter, ``dim_arg`` 2) along a dim of ``size``, normalised; None
    for a step other than 1."""
    args = node.args
    start = args[dim_arg + 1] if len(args) > dim_arg + 1 and args[dim_arg + 1] is not None else 0
    end = args[dim_arg + 2] if len(args) > dim_arg + 2 and args[dim_arg + 2] is not None else size
    if (args[dim_arg + 3] if len(args) > dim_arg + 3 else 1) != 1:
        return None
    return (start + size if start < 0 else start), min(end + size if end < 0 else end, size)


def _offsets(blocks: tuple[int, ...]) -> list[int]:
    return [sum(blocks[:i]) for i in range(len(blocks) + 1)]


def block_range(node: Node, placement: PackedShard, dim_arg: int = 1) -> tuple[int, int] | None:
    """The blocks ``[i, j)`` of ``placement`` that ``node`` (a slice, or a slice_scatter with ``dim_arg`` 2) covers
    exactly, with step 1; None when it cuts a block."""
    bounds = _slice_bounds(node, sum(placement.blocks), dim_arg)
    offsets = _offsets(placement.blocks)
    if bounds is None or bounds[0] not in offsets or bounds[1] not in offsets or bounds[1] <= bounds[0]:
        return None
    return offsets.index(bounds[0]), offsets.index(bounds[1])


def _refined_blocks(node: Node, placement) -> tuple[int, ...] | None:
    """The blocks that a slice (step 1) along the sharded dim would take whole: the layout's own boundaries and
    the slice's two ends (``x[..., :n]`` of a fused [gate; value] projection: blocks (n, n))."""
    size = shape_of(node.args[0])[placement.dim]
    bounds = _slice_bounds(node, size)
    if bounds is None:
        return None
    cuts = sorted(set(_offsets(placement.blocks if isinstance(placement, PackedShard) else (size,))) | set(bounds))
    refined = tuple(b - a for a, b in zip(cuts, cuts[1:]) if b > a)
    return refined if len(refined) > 1 else None


def blocks_placement(placement: PackedShard, i: int, j: int):
    """Blocks ``[i, j)`` of a packed layout: a plain shard for one block, a packed one for several."""
    return Shard(placement.dim) if j - i == 1 else PackedShard(placement.dim, placement.blocks[i:j])


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
    blocks = tuple(int(p.shape[dim]) for p in pieces)
    if isinstance(placement, PackedShard) and placement.blocks == blocks:
        return Decision(tuple(Shard(dim) for _ in pieces), {source: placement})
    if isinstance(placement, Shard) and len(blocks) > 1 and all(b % axis_size == 0 for b in blocks):
        raise NeedsPacking(source, blocks)
    raise Unshardable(f"split into {list(blocks)} along the sharded dim {dim} ({placement})")



def _tensor_list_op(node: Node, placements) -> tuple[list[Node], int, dict[Node, object]]:
    """cat / stack: the tensors, the dim (normalised to the output's rank), the sharded inputs."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.args[0], norm_dim(dim, len(shape_of(node))), sharded_inputs(node, placements)


@register(aten.cat.default)
def cat(node: Node, placements, axis_size: int) -> Decision:
    """cat along another dim keeps a common sharding; along the sharded dim, every piece sharded on its own (a
    joint text + image sequence) makes a packed layout whose blocks are the pieces (and a packed piece's blocks)."""
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
    blocks, inputs = (), {}
    for n in tensors:
        placement = placements.get(n, R)
        inputs[n] = placement if isinstance(placement, PackedShard) else Shard(dim)
        blocks += placement.blocks if isinstance(placement, PackedShard) else (shape_of(n)[dim],)
    if any(b % axis_size for b in blocks):
        raise Unshardable(f"cat along the sharded dim of blocks {list(blocks)} not divisible by {axis_size}")
    return Decision(PackedShard(dim, blocks), inputs)


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
