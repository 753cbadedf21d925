"""Elementwise ops: broadcasting pointwise ops (every op PyTorch tags pointwise), and the ops that act like them on
one input (casts, copies, ``*_like``), listed as data."""

from __future__ import annotations

import torch
from torch.fx import Node

from .core import Decision, R, Unshardable, register, same_as_input, shape_of, sharded_inputs, with_dim

aten = torch.ops.aten

# Output placed like the first input, the only one whose values matter.
SAME_AS_INPUT = (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
                 aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.contiguous.default,
                 aten.dropout.default, aten.alias.default, aten.detach.default, aten.fill.Scalar,
                 aten.fill.Tensor)  # fill: self's shape, every element one (replicated) value
# Take only dtype and device from their input: a new, whole tensor.
CREATION_FROM = (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
# Arguments read for their dtype, device or shape only (argument indices): whatever placement arrives serves, so a
# partial sum reduced for its other readers is read reduced here too (insert_collectives).
METADATA_ARGUMENTS = {aten.type_as.default: (1,), **{op: (0,) for op in CREATION_FROM}}
# Ops that make a tensor of a size they name (argument index), whatever their inputs hold: a rank can make just
# its part of one (``localize`` names the local size).
SIZE_ARGUMENT = {**{op: 1 for op in CREATION_FROM}, aten.zeros.default: 0, aten.ones.default: 0,
                 aten.full.default: 0, aten.empty.memory_format: 0}


@register("pointwise", aten.copy.default, aten.expand_as.default)  # copy, expand_as: the second operand's shape
def pointwise(node: Node, placements, axis_size: int) -> Decision:
    """Broadcasting elementwise ops: every sharded input must agree on one output dim; replicated inputs that span
    that dim are sliced locally, broadcast ones (size 1 or missing) stay whole."""
    out_shape = shape_of(node)
    ndim = len(out_shape)
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return Decision(R, {n: R for n in node.all_input_nodes})
    out_placements = {with_dim(p, p.dim + ndim - len(shape_of(n))) for n, p in sharded.items()}
    if len(out_placements) != 1:
        raise Unshardable(f"inputs sharded differently: {sorted(map(str, out_placements))}")
    out = out_placements.pop()
    inputs = {}
    for n in node.all_input_nodes:
        shape = shape_of(n)
        if n in sharded or shape is None:
            inputs[n] = placements.get(n, R)
            continue
        local_dim = out.dim - (ndim - len(shape))
        inputs[n] = R if local_dim < 0 or shape[local_dim] == 1 else with_dim(out, local_dim)
    return Decision(out, inputs)


def pointwise_on(node: Node, placements, operands) -> Decision:
    """Pointwise agreement between ``operands`` (all of the output's rank); other inputs replicated."""
    sharded = {n: placements[n] for n in operands if n in sharded_inputs(node, placements)}
    inputs = {n: R for n in node.all_input_nodes}
    if not sharded:
        return Decision(R, inputs)
    if len(set(sharded.values())) != 1:
        raise Unshardable("operands sharded differently")
    out = next(iter(sharded.values()))
    for n in operands:
        inputs[n] = out
    return Decision(out, inputs)


@register(*SAME_AS_INPUT)
def unary(node: Node, placements, axis_size: int) -> Decision:
    return same_as_input(node, placements, node.args[0])


@register(aten.type_as.default)
def type_as(node: Node, placements, axis_size: int) -> Decision:
    """The second argument only lends its dtype."""
    return same_as_input(node, placements, node.args[0], dont_care=(node.args[1],))


@register(*CREATION_FROM)
def creation_from(node: Node, placements, axis_size: int) -> Decision:
    return Decision(R, {n: placements.get(n, R) for n in node.all_input_nodes})


@register(aten.outer.default)
def outer(node: Node, placements, axis_size: int) -> Decision:
    """outer(a, b)[i, j] = a[i] * b[j]: a's rows are the output's rows, b's its columns (rotary angles from
    positions and frequencies)."""
    a, b = node.args[:2]
    sharded = sharded_inputs(node, placements)
    if not sharded:
        return Decision(R, {a: R, b: R})
    if len(sharded) > 1:
        raise Unshardable("outer product of two sharded vectors")
    return Decision(with_dim(sharded[a], 0) if a in sharded else with_dim(sharded[b], 1),
                    {n: sharded.get(n, R) for n in (a, b)})  # a partial sum is reduced first
