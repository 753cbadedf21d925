"""Placement propagation rules, one file per op family, each rule registered beside its definition.

- ``core``: the ``Decision`` a rule returns, the registry (``register``, ``rule_for``), shared helpers;
- ``pointwise``: broadcasting elementwise ops (PyTorch's pointwise tag) and cast/copy/``*_like`` ops as tables;
- ``views``: views, reshapes, permutes, slices;
- ``joins``: split, chunk, unbind, cat, stack, pad (the pieces of a packed layout);
- ``indexing``: index_select, index_copy, slice/select scatters (functionalized slice assignment);
- ``reductions``: sums, means, norms;
- ``conv``: convolutions (batch, channels in whole groups, or rows by a halo exchange);
- ``spatial``: group norms and nearest upsampling over images split along a spatial dim;
- ``matmul``: matmul / bmm / mm (batch, row, column or contracted shards);
- ``linear``: ``aten.linear`` per the planner's roles (tensor axis), row by row (sequence axis);
- ``attention``: head-sharded attention, and the Ulysses exchange on a sequence axis;
- ``written_attention``: attention written out as matmul, elementwise ops, softmax, matmul, sequence-sharded alike;
- ``collectives``: graphs that already communicate are refused;
- ``propagate``: the sweep both planners run (each node's decision in graph order);
- ``sequence_dims``: which dim of each value holds an attention's rows, read from the rules.

A new rule is a function ``rule(node, placements, axis_size) -> Decision`` decorated with
``@register(aten.op.overload, ...)`` in the file of its family (see ``core`` for the contract).
"""

from ..errors import PartitionError
from . import (attention, collectives, conv, indexing, joins, linear, matmul,  # noqa: F401  (they register their rules)
               reductions, spatial, views, written_attention)
from .core import (RULES, Decision, LinearRoles, NeedsPacking, NeedsUnit, Unshardable, register, replicate_all,
                   rule_for, shape_of)
from .pointwise import pointwise
from .views import view_groups, view_placement

__all__ = ["RULES", "Decision", "LinearRoles", "NeedsPacking", "NeedsUnit", "PartitionError", "Unshardable",
           "pointwise", "register", "replicate_all", "rule_for", "shape_of", "view_groups", "view_placement"]
