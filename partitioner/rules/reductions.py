"""Reductions, norms and ops along one dim (sort, topk, cumsum): fine along any dim but the one they work along."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ..placement import Partial, is_sharded
from ..mesh import SEQUENCE_AXES
from .core import (Decision, R, Unshardable, norm_dim, register, register_factory, same_as_input, shape_of,
                   with_dim)

aten = torch.ops.aten


@register(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def reduction(node: Node, placements, axis_size: int) -> Decision:
    """sum / mean / amax / amin over some dims: fine unless the sharded dim is one of them."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _reduced(node, placements, dims, keepdim)


@register(aten.linalg_vector_norm.default)
def vector_norm(node: Node, placements, axis_size: int) -> Decision:
    """``linalg_vector_norm(x, ord, dim, keepdim)`` (``F.normalize``, a VAE's RMS norm over channels): fine unless
    the sharded dim is one of the reduced dims."""
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    return _reduced(node, placements, dims, keepdim)


def _reduced(node: Node, placements, dims, keepdim: bool) -> Decision:
    """A reduction of ``node.args[0]`` over ``dims`` (None: all): the shard follows its dim, unless reduced."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement):
        return decision
    ndim = len(shape_of(source))
    dims = all_dims(dims, ndim)
    if placement.dim in dims:
        raise Unshardable(f"{node.target.__name__} reduces over the sharded dim {placement.dim}")
    shift = 0 if keepdim else sum(d < placement.dim for d in dims)
    return Decision(with_dim(placement, placement.dim - shift), decision.inputs)


@register(aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, aten.log_softmax.int,
          aten._log_softmax.default)
def softmax(node: Node, placements, axis_size: int) -> Decision:
    """softmax / log_softmax over one dim: each slice along it normalised on its own, so fine unless the sharded
    dim is that one (a written-out attention's scores split by heads or by query rows)."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if is_sharded(placement) and placement.dim == norm_dim(node.args[1], len(shape_of(source))):
        raise Unshardable(f"{node.target.__name__} normalises over the sharded dim {placement.dim}")
    return decision


# ops that order, select or accumulate along one dim, each slice along it on its own: (op, where its dim is given
# (position, keyword), the dim when not given)
_ALONG_ONE_DIM = {aten.sort.default: (1, -1), aten.sort.stable: (None, -1), aten.argsort.default: (1, -1),
                  aten.argsort.stable: (None, -1), aten.topk.default: (2, -1), aten.cumsum.default: (1, None),
                  aten.cumprod.default: (1, None), aten.cummax.default: (1, None), aten.cummin.default: (1, None),
                  aten.logcumsumexp.default: (1, None)}


@register(*_ALONG_ONE_DIM)
def along_one_dim(node: Node, placements, axis_size: int) -> Decision:
    """sort / argsort / topk / cumsum / cumprod / cummax / cummin / logcumsumexp along one dim: every slice along it
    ordered (selected, summed) on its own, so a shard along any other dim is carried, values and indices alike (the
    indices count along the whole dim); sharded along that dim it is refused (an order or a prefix spans the
    ranks)."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    position, default = _ALONG_ONE_DIM[node.target]
    dim = node.args[position] if position is not None and len(node.args) > position else \
        node.kwargs.get("dim", default)
    if is_sharded(placement) and placement.dim == norm_dim(dim, len(shape_of(source))):
        raise Unshardable(f"{node.target.__name__} runs along the sharded dim {placement.dim}")
    if isinstance(node.meta.get("val"), (tuple, list)):  # (values, indices)
        return Decision(tuple(decision.output for _ in node.meta["val"]), decision.inputs)
    return decision


@register(aten.rms_norm.default, aten.layer_norm.default)
def norm(node: Node, placements, axis_size: int) -> Decision:
    """rms_norm / layer_norm: fine unless the sharded dim is one of the normalised (last) dims."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if is_sharded(placement):
        ndim = len(shape_of(source))
        if placement.dim >= ndim - len(node.args[1]):
            raise Unshardable(f"{node.target.__name__} normalises over the sharded dim {placement.dim}")
    return decision


# Ops a projection's output may pass through (cast, squared, scaled and shifted per feature) before its norm's
# statistics.
_ON_THE_WAY = {aten.pow.Tensor_Scalar, aten._to_copy.default, aten.to.dtype, aten.mul.Tensor, aten.square.default,
               aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor}


# Ops that rearrange one value without computing (a fused projection's heads viewed apart, unbound into q, k, v).
_REARRANGING = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unbind.int,
                aten.split.Tensor, aten.split_with_sizes.default, operator.getitem}


def _projected(node: Node, steps: int = 8) -> bool:
    """``node`` is a Linear's output, perhaps cast, squared (``x.float().pow(2)``), scaled and shifted per
    feature (a quantised Linear's scales and bias, applied after its product) or rearranged (a fused q, k, v
    projection viewed into heads and unbound): a column-parallel region whose norm pays one small all_reduce to
    stay sharded. A norm of anything else (the residual stream after a gated add) is not split: its consumers
    would turn row-parallel, trading small reductions for large ones."""
    for _ in range(steps):
        if node.target is aten.linear.default:
            return True
        if node.target in _REARRANGING and isinstance(node.args[0], Node):
            node = node.args[0]
            continue
        if node.target not in _ON_THE_WAY:
            return False
        full = {n for n in node.all_input_nodes if shape_of(n) == shape_of(node)}
        others = [n for n in node.all_input_nodes if n not in full]
        if len(full) != 1 or any(len(shape_of(n) or ()) > 1 for n in others):  # (per feature: vectors, scalars)
            return False
        node = full.pop()
    return False


@register(aten.sum.dim_IntList, aten.mean.dim, axis="tensor")
def tensor_parallel_sum(node: Node, placements, axis_size: int) -> Decision:
    """sum / mean over the tensor-parallel shard of a projection: each rank reduces its features, the result is a
    partial sum (a mean is scaled by its share of the features when localized), reduced where it is consumed: a
    norm written out (``x.pow(2).mean(-1)``) over q/k projections costs one all_reduce of ``[rows, 1]``."""
    source = node.args[0]
    placement = placements.get(source, R)
    if _over_sharded_dim(node, placement) and _projected(source):
        return Decision(Partial(), {source: placement})
    return reduction(node, placements, axis_size)


@register_factory(aten.sum.dim_IntList, axis="sequence")
@register_factory(aten.mean.dim, axis="sequence")
def make_sequence_sum(roles, axis: str):
    """Over a sequence axis, a reduction over the split rows is a partial sum; over a batch axis (dp, cfg) it is
    refused: each rank's batch entries are computed on their own, with no collective in between."""
    return sequence_sum if axis in SEQUENCE_AXES else reduction


def sequence_sum(node: Node, placements, axis_size: int) -> Decision:
    """sum / mean over the sharded rows of a sequence: each rank reduces its rows, the result is a partial sum
    (a mean scaled by its share of the rows, ``insert_collectives``) reduced where it is consumed: a linear
    attention's key sum (``k.sum(-1)``, its normaliser) costs one all_reduce of ``[heads, d]`` instead of the
    sequence gathered. amax / amin over the rows stay refused (a partial maximum is not a partial sum)."""
    source = node.args[0]
    placement = placements.get(source, R)
    if _over_sharded_dim(node, placement):
        return Decision(Partial(), {source: placement})
    return reduction(node, placements, axis_size)


def _over_sharded_dim(node: Node, placement) -> bool:
    """A sum / mean ``node`` reduces over the dim ``placement`` shards its input along."""
    dims = node.args[1] if len(node.args) > 1 else None
    return is_sharded(placement) and placement.dim in all_dims(dims, len(shape_of(node.args[0])))


def all_dims(dims, ndim: int) -> list[int]:
    """A reduction's dims, non-negative; None or an empty list reduces every dim (``x.sum(dim=())`` as aten has
    it)."""
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    return [norm_dim(d, ndim) for d in dims] or list(range(ndim))


@register(aten.rms_norm.default, aten.layer_norm.default, axis="tensor")
def tensor_parallel_norm(node: Node, placements, axis_size: int) -> Decision:
    """rms_norm / layer_norm over a last dim that is column-sharded: each rank normalises its features with the
    row statistics reduced over the ranks (``collectives.sharded_rms_norm``), its weight and bias sliced alike."""
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement) or len(node.args[1]) != 1 or placement.dim != len(shape_of(source)) - 1 \
            or not _projected(source):
        return norm(node, placements, axis_size)
    inputs = {n: R for n in node.all_input_nodes}
    inputs[source] = placement
    affine = node.args[2:4] if node.target is aten.layer_norm.default else node.args[2:3]
    for parameter in affine:
        if parameter is not None:
            inputs[parameter] = with_dim(placement, 0)
    return Decision(placement, inputs)
