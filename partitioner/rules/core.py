"""What every rule shares: the ``Decision`` a rule returns, the registry that maps an aten op to its rule, and the
helpers that place inputs like an output.

A rule sees a node and the placement each of its inputs currently has (``placements``: what consumers of that input
see, along one mesh axis of ``axis_size`` ranks) and returns a ``Decision``: the placement of the node's output and
the placement each input must have. An input whose placement differs from the one required is redistributed by
``insert_collectives``. A rule raises ``Unshardable`` when a sharded input cannot be carried through the op; the
planner then gives up the sharding that led there (or gathers it first, for a sharding the user forced). It raises
``NeedsPacking`` or ``NeedsUnit`` when the op could carry the value if its producer split it differently (at the
cuts of a split, in whole heads); the planner asks the producer for that layout and sweeps again.

Rules are registered beside their definitions with ``@register(op, ...)``, for every mesh axis or for one kind of
axis: "tensor" (tp: Linear features split) or "sequence" (ulysses: rows split). Some rules depend on the planner's
state (which Linears are column-wise) or on the axis name; they are registered as factories and built by
``rule_for``. An op without a rule is carried only when PyTorch tags it pointwise; otherwise its inputs are
replicated, and a sharded input makes it ``Unshardable`` (never passed through). An op that writes in place is never
carried: ``trace`` functionalizes graphs that have such ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch.fx import Node

from ..placement import PackedShard, Partial, Replicate, Shard, is_sharded

aten = torch.ops.aten
R = Replicate()
AXIS_KINDS = ("tensor", "sequence")


class Unshardable(Exception):
    """A sharded value reached an op that cannot carry it. ``where``: the module (or node) the refusal is about,
    when the rule names one; its text is then ``where: detail``."""

    def __init__(self, detail: str, where: str = ""):
        super().__init__(f"{where}: {detail}" if where else detail)
        self.detail, self.where = detail, where


@dataclass(frozen=True)
class NeedsPacking(Exception):
    """A value sharded as one block is split into ``blocks`` along its sharded dim: its producer must be packed."""
    node: Node
    blocks: tuple[int, ...]

    def __str__(self) -> str:
        return f"{getattr(self.node, 'name', 'a value')} is split into blocks {list(self.blocks)} that its producer could not pack"


@dataclass(frozen=True)
class NeedsUnit(Exception):
    """A value sharded in pieces that would cut a group an op keeps whole (a head reshape would split a head): the
    producer must shard in whole ``unit``s. The planner asks the seeds that reached ``node`` for that unit, which
    is right when ``node`` has their features' coordinates (a Linear's output, or pieces of it); otherwise the
    same request comes back unchanged and the seeds are dropped."""
    node: Node
    unit: int

    def __str__(self) -> str:
        return f"{getattr(self.node, 'name', 'a value')} would be cut inside groups of {self.unit} that its producer could not keep whole"


@dataclass
class Decision:
    output: object  # a placement, or a tuple of placements for ops returning several tensors
    inputs: dict[Node, object] = field(default_factory=dict)
    # What consumers get, when it differs from what the op computes: redistributed right after the op
    # (Ulysses attention computes head-sharded and hands back sequence-sharded; a gathered column shard).
    visible: object = None

    @property
    def seen(self):
        """The placement consumers see."""
        return self.output if self.visible is None else self.visible


@dataclass
class LinearRoles:
    """What the tensor-parallel planner decided for each ``aten.linear`` node, read by the linear rule."""
    colwise: set[Node] = field(default_factory=set)
    rowwise: set[Node] = field(default_factory=set)
    replicate: set[Node] = field(default_factory=set)
    forced: set[Node] = field(default_factory=set)  # chosen by the user: never silently changed
    packed: dict[Node, tuple[int, ...]] = field(default_factory=dict)
    units: dict[Node, int] = field(default_factory=dict)  # column shards split in whole units (heads)


Rule = Callable[[Node, dict, int], Decision]
RULES: dict[tuple[str, object], Rule] = {}  # (axis kind or "any", op) -> rule
FACTORIES: dict[tuple[str, object], Callable] = {}  # (axis kind, op) -> factory(roles, axis name) -> rule


def register(*targets, axis: str = "any") -> Callable[[Rule], Rule]:
    """Register the decorated rule for every op in ``targets`` on ``axis`` kind ("any", "tensor", "sequence")."""
    def decorate(rule: Rule) -> Rule:
        for target in targets:
            RULES[(axis, target)] = rule
        return rule
    return decorate


def register_factory(target, axis: str) -> Callable:
    """Register a function ``(roles, axis_name) -> rule`` for a rule that depends on the planner's state."""
    def decorate(factory: Callable) -> Callable:
        FACTORIES[(axis, target)] = factory
        return factory
    return decorate


def rule_for(node: Node, roles: LinearRoles | None = None, sequence_axis: str | None = None) -> Rule:
    """The rule for ``node``: tensor-parallel (Linears by ``roles``), or with ``sequence_axis`` (an axis name) the
    rules of a sequence-parallel axis (row-local Linears, Ulysses attention)."""
    if node.op == "output":
        return graph_output
    target = node.target
    if getattr(getattr(target, "_schema", None), "is_mutable", False):
        return no_rule  # trace functionalizes; a write in place that is left is never carried
    kind = "sequence" if sequence_axis else "tensor"
    if (kind, target) in FACTORIES:
        return FACTORIES[(kind, target)](roles, sequence_axis)
    rule = RULES.get((kind, target)) or RULES.get(("any", target))
    if rule is not None:
        return rule
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return RULES[("any", "pointwise")]
    return no_rule


def shape_of(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def with_dim(placement, dim: int):
    """``placement`` moved to ``dim`` (a packed shard keeps its blocks and unit)."""
    if isinstance(placement, PackedShard):
        return replace(placement, dim=dim)
    return Shard(dim)


def replicate_all(node: Node, placements) -> Decision:
    """The fallback for any op: every input replicated (reduced, gathered), output replicated."""
    del placements
    if node.op == "output":
        return Decision(None, {n: R for n in node.all_input_nodes})
    out = tuple(R for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else R
    return Decision(out, {n: R for n in node.all_input_nodes})


def sharded_inputs(node: Node, placements) -> dict[Node, object]:
    return {n: placements[n] for n in node.all_input_nodes if is_sharded(placements.get(n, R))}


def same_as_input(node: Node, placements, source: Node, *, dont_care: tuple[Node, ...] = ()) -> Decision:
    """Output placed like ``source``; other tensor inputs replicated unless listed as ``dont_care``."""
    inputs = {n: R for n in node.all_input_nodes}
    for n in dont_care:
        inputs[n] = placements.get(n, R)
    inputs[source] = placements.get(source, R)
    if isinstance(inputs[source], Partial):
        inputs[source] = R
    return Decision(inputs[source], inputs)


def graph_output(node: Node, placements, axis_size: int) -> Decision:
    """The model returns full tensors."""
    if sharded_inputs(node, placements):
        raise Unshardable("the graph output needs full tensors")
    return Decision(None, {n: R for n in node.all_input_nodes})


def no_rule(node: Node, placements, axis_size: int) -> Decision:
    if sharded_inputs(node, placements):
        raise Unshardable(f"{node.target} has no sharding rule")
    return replicate_all(node, placements)


@register(operator.getitem)
def getitem(node: Node, placements, axis_size: int) -> Decision:
    """One output of a multi-output op: its placement."""
    source, index = node.args
    placement = placements.get(source, R)
    out = placement[index] if isinstance(placement, tuple) else R
    return Decision(out, {source: placement})
