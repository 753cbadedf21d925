"""aten.linear: column-wise, row-wise or replicated over a tensor axis as the planner's roles say; row by row with
the whole weight over a sequence axis."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from ..placement import Partial, Shard, is_sharded, packed_shard
from .core import Decision, LinearRoles, R, Unshardable, register, register_factory, shape_of, with_dim
from .views import too_few_heads

aten = torch.ops.aten


@register_factory(aten.linear.default, axis="tensor")
def make_linear_rule(roles: LinearRoles, axis: str | None = None) -> Callable:
    def linear(node: Node, placements, axis_size: int) -> Decision:
        """y = x W^T + b. Sharded features in -> row-wise (W split on dim 1, output Partial). Replicated in ->
        column-wise if planned (W split on dim 0, unevenly if need be, in the planned units: whole heads),
        row-wise if planned (x sliced locally), else replicated.
        Sharded rows (any other dim of x) pass through with a replicated weight."""
        x, weight = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else None
        px = placements.get(x, R)
        px = R if isinstance(px, Partial) else px
        ndim = len(shape_of(x))
        inputs = {x: px, weight: R}
        if bias is not None:
            inputs[bias] = R
        if (is_sharded(px) and px.dim == ndim - 1) or node in roles.rowwise:
            if node in roles.replicate or (node in roles.colwise and node in roles.forced):
                raise Unshardable(f"{'replicated' if node in roles.replicate else 'column-wise'} linear planned by "
                                  "the user receives sharded features")
            feature = px if is_sharded(px) and px.dim == ndim - 1 else Shard(ndim - 1)
            inputs[x] = feature
            inputs[weight] = with_dim(feature, 1)
            return Decision(Partial(), inputs)
        if is_sharded(px):  # rows sharded (sequence parallel): each rank applies the whole weight to its rows
            return Decision(px, inputs)
        if node in roles.colwise:
            too_few_heads(node, axis_size)
            blocks = roles.packed.get(node) or (shape_of(weight)[0],)
            unit = roles.units.get(node, 1)
            if any(block % unit for block in blocks):
                raise Unshardable(f"output blocks {list(blocks)} are not whole units of {unit}")
            if any(block // unit < axis_size for block in blocks):
                raise Unshardable(f"output features {list(blocks)} in units of {unit} leave some of the "
                                  f"{axis_size} ranks nothing")
            placement = packed_shard(0, blocks, unit, axis_size)
            inputs[weight] = placement
            if bias is not None:
                inputs[bias] = placement
            return Decision(with_dim(placement, len(shape_of(node)) - 1), inputs)
        return Decision(R, inputs)
    return linear


@register(aten.linear.default, axis="sequence")
def row_local_linear(node: Node, placements, axis_size: int) -> Decision:
    """Over a sequence axis a linear is applied row by row with the whole weight: rows may be sharded,
    features may not."""
    x = node.args[0]
    px = placements.get(x, R)
    if is_sharded(px) and px.dim == len(shape_of(x)) - 1:
        raise Unshardable("features sharded over a sequence-parallel axis")
    px = R if isinstance(px, Partial) else px  # a partial sum (a mean of the rows) is summed first: one bias added
    inputs = {n: R for n in node.all_input_nodes}
    inputs[x] = px
    return Decision(px, inputs)
