"""Reductions and norms: fine along any dim but the sharded one."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..placement import is_sharded
from .core import R, Decision, Unshardable, norm_dim, register, same_as_input, shape_of, with_dim

aten = torch.ops.aten


@register(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def reduction(node: Node, placements, axis_size: int) -> Decision:
    """sum / mean / amax / amin over some dims: fine unless the sharded dim is one of them."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement):
        return decision
    ndim = len(shape_of(source))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(ndim)) if dims is None else [norm_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if placement.dim in dims:
        raise Unshardable(f"{node.target.__name__} reduces over the sharded dim {placement.dim}")
    shift = 0 if keepdim else sum(d < placement.dim for d in dims)
    return Decision(with_dim(placement, placement.dim - shift), decision.inputs)


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
