"""plan_sharding: decide how every linear is split over the "tp" axis, and give every value a placement.

Requires: annotate_heads has run (head splits are head_dim-based; they carry ``annotation.heads``).
Guarantees: every node carries ``annotation.placements = {"tp": placement}`` (a tuple for multi-output ops) and
``annotation.required = {"tp": {input node: placement}}``, the placement each input must have for that node. Where the
two disagree, ``insert_collectives`` redistributes. Parameters and buffers are placed as their consumers need them
(they are sliced at load time, never in the graph).

How the plan is found, from the graph's structure alone (no per-model list):

1. Every linear starts as a column-wise candidate (a "seed"). Placements are propagated through the graph with the
   rules in ``partitioner/rules/`` (one sweep of ``partitioner/rules/propagate.py`` per round). A linear whose input features arrive sharded becomes row-wise (its output is
   Partial and is all-reduced). Candidates whose sharding reaches an op that cannot carry it (a norm over the
   features, a reshape that mixes features with rows, the graph output, ...) are dropped and propagation reruns,
   until nothing fails. What remains are column -> row regions: q/k/v -> heads -> attention -> output projection;
   up -> activation -> down; a fused ``[value; gate]`` projection becomes a packed column shard (each half split on
   its own) when a split along the sharded dim asks for it.
2. A linear left replicated whose input has few rows compared with its input features (``rows * 8 <= in_features``:
   the all-reduce of its output moves far fewer bytes than the weight it spreads) is split row-wise with its
   replicated input sliced locally. For MiniMax-H3 this is ``adaln_proj.linear``: one row per timestep against 2688
   features, about 40% of all weights.
3. User overrides in diffusers' ``_tp_plan`` key syntax ("colwise" / "rowwise" / "replicate") take precedence. A
   forced column shard whose values meet an op that cannot carry them is gathered (all_gather) right after it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ..decisions import LinearSharding, Style
from ..errors import InvariantError, PartitionError, did_you_mean
from ..placement import Partial, Replicate, any_sharded, block_offsets, is_sharded, shard_widths, unit_of
from ..rules import Decision, LinearRoles, NeedsPacking, NeedsUnit, rule_for, shape_of
from ..rules.core import with_dim
from ..rules.propagate import sweep
from ..rules.views import degree_above_heads
from .context import PassContext
from ..annotations import annotation

AXIS = "tp"
# Row-wise with a replicated input pays off when the input has this many times fewer rows than features.
ROWWISE_INPUT_RATIO = 8
aten = torch.ops.aten
R = Replicate()


@dataclass
class _Propagation:
    placements: dict[Node, object] = field(default_factory=dict)
    decisions: dict[Node, Decision] = field(default_factory=dict)
    failed: dict[Node, str] = field(default_factory=dict)  # seed -> why its column sharding was dropped
    failed_forced: set[Node] = field(default_factory=set)  # user-forced column shards that must be gathered
    packing: dict[Node, tuple[int, ...]] = field(default_factory=dict)
    units: dict[Node, int] = field(default_factory=dict)  # seed -> the coarser unit its sharding must split in


def linear_path(linear: Node, fqns: dict[Node, str]) -> str:
    """A Linear's module path: its weight's, without the last name (a 1x1 convolution's weight is squeezed)."""
    weight = linear.args[1]
    weight = weight.args[0] if weight.target is aten.squeeze.dims else weight
    return fqns[weight].rsplit(".", 1)[0] if weight in fqns else linear.name


def _match_overrides(paths: dict[Node, str], plan: dict[str, str]) -> dict[Node, Style]:
    forced = {}
    styles = [style.value for style in Style]
    for pattern, style in plan.items():
        if style not in styles:
            raise PartitionError(f"plan entry {pattern!r}: unknown style {style!r}{did_you_mean(style, styles)}; use "
                                 f"one of {styles}")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"$")
        matched = [node for node, path in paths.items() if regex.match(path)]
        if not matched:
            raise PartitionError(f"plan entry {pattern!r} matches no Linear module"
                                 f"{did_you_mean(pattern, set(paths.values()))}; linear modules look like "
                                 f"{sorted(paths.values())[:3]}")
        for node in matched:
            forced[node] = Style(style)
    return forced


def _propagate(gm: GraphModule, roles: LinearRoles, gathered: set[Node], degree: int) -> _Propagation:
    """One sweep (``partitioner.rules.propagate``): placements for every node, and which column candidates failed and why.

    A ``gathered`` linear keeps its column-sharded output, but its consumers see it replicated, so that
    insert_collectives gathers it once, right after the linear."""
    def adjust(node: Node, decision: Decision) -> Decision:
        if node in gathered:
            decision.visible = R
        return decision

    def is_seed(node: Node, decision: Decision) -> bool:
        return node in roles.colwise and any_sharded(decision.seen)

    swept = sweep(gm, lambda node: rule_for(node, roles), degree, adjust=adjust, is_seed=is_seed)
    result = _Propagation(placements={node: d.output for node, d in swept.decisions.items()},
                          decisions=swept.decisions)
    for failure in swept.failures:
        droppable = failure.seeds - roles.forced
        seed = next(iter(failure.seeds)) if len(failure.seeds) == 1 else None
        refined = _refined_packing(result.packing.get(seed, roles.packed.get(seed)), shape_of(seed)[-1],
                                   failure.problem.blocks) \
            if isinstance(failure.problem, NeedsPacking) and seed is not None and droppable else None
        if refined is not None and refined != roles.packed.get(seed):
            result.packing[seed] = refined
        elif isinstance(failure.problem, NeedsUnit) and _coarser(failure.seeds, failure.problem.unit, roles, result):
            pass  # the seeds split in whole units next round (a unit they already have would fail again)
        else:
            for seed in droppable:
                result.failed.setdefault(seed, f"{failure.node.name}: {failure.problem}")
            result.failed_forced |= failure.seeds & roles.forced
    return result


def _low_rank_branches(sweep: _Propagation, roles: LinearRoles) -> dict[Node, str]:
    """Column seeds to drop for a branch beside a column-parallel projection of the same input, added to its output:
    ``base(x) + B(A(x)) * scale`` (a LoRA adapter). Sharding A by columns makes B row-wise, and B's Partial sum then
    needs an all_reduce to join base's column shard; with A whole, B is a column shard like base and the branch
    needs no collective."""
    found = {}
    for node, decision in sweep.decisions.items():
        if node.target is not aten.add.Tensor:
            continue
        for source, required in decision.inputs.items():
            if not is_sharded(required) or is_sharded(sweep.placements.get(source)):
                continue  # (the branch's whole or partial sum, read as a shard: sliced after its all_reduce)
            row = _single_source(source, lambda n: n.target is aten.linear.default
                                 and isinstance(sweep.placements.get(n), Partial))
            column = None if row is None else _single_source(
                row.args[0], lambda n: n in roles.colwise and n not in roles.forced)
            others = [n for n in node.all_input_nodes if n is not source]
            base = _single_source(others[0], lambda n: n in roles.colwise and n.target is aten.linear.default) \
                if len(others) == 1 else None
            if column is not None and base is not None and _root(column.args[0]) is _root(base.args[0]):
                found.setdefault(column, f"{node.name}: a low-rank branch ({column.name} -> {row.name}) beside the "
                                         f"column shard {base.name} of the same input; kept whole, the branch is "
                                         "column-sharded with no collective")
    return found


def _single_source(node: Node, wanted) -> Node | None:
    """The node ``wanted`` picks, found from ``node`` back through ops of one tensor input (a scaling, a dropout);
    None where the chain branches (or starts) first."""
    while not wanted(node):
        inputs = _tensor_inputs(node)
        if len(inputs) != 1 or node.op != "call_function":
            return None
        node = inputs[0]
    return node


def _root(node: Node) -> Node:
    """Where the chain of one-tensor-input ops that ends at ``node`` starts."""
    while node.op == "call_function" and len(_tensor_inputs(node)) == 1:
        node = _tensor_inputs(node)[0]
    return node


def _tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _refined_packing(current: tuple[int, ...] | None, total: int, request: tuple[int, ...]) -> tuple[int, ...] | None:
    """The seed's packed blocks with a split request's cuts added. A request is in the coordinates of the value that
    is split: the seed's whole output, or one piece of it (a fused qkv + MLP projection split in two, then the qkv
    piece in three): a piece is found as the one run of the current blocks of its size. A request some run already
    satisfies changes nothing; None when no run, or more than one, fits."""
    base = current or (total,)
    offsets = block_offsets(base)
    starts = [0] if sum(request) == total else [
        offsets[i] for i in range(len(offsets)) for j in range(i + 1, len(offsets))
        if offsets[j] - offsets[i] == sum(request)]
    candidates = [tuple(b - a for a, b in zip(cuts, cuts[1:])) for cuts in
                  (sorted(set(offsets) | {start + offset for offset in block_offsets(request)}) for start in starts)]
    if base in candidates:
        return base
    return candidates[0] if len(candidates) == 1 else None


def _coarser(seeds, unit: int, roles: LinearRoles, result: _Propagation) -> bool:
    """Ask ``seeds`` to split in multiples of ``unit``; False when none of them would change."""
    changed = False
    for seed in seeds:
        current = result.units.get(seed, roles.units.get(seed, 1))
        if math.lcm(current, unit) != current:
            result.units[seed] = math.lcm(current, unit)
            changed = True
    return changed


def _cheap_rowwise(linear: Node, degree: int) -> bool:
    x_shape, w_shape = shape_of(linear.args[0]), shape_of(linear.args[1])
    rows, in_features = math.prod(x_shape[:-1]), w_shape[1]
    return rows * ROWWISE_INPUT_RATIO <= in_features and in_features >= degree  # uneven features split too


def _wanted(node: Node, decisions: dict[Node, Decision]):
    """The one placement every consumer of ``node`` requires; None when they differ."""
    wanted = {repr(decisions[user].inputs.get(node, R)): decisions[user].inputs.get(node, R) for user in node.users}
    return next(iter(wanted.values())) if len(wanted) == 1 else None


def _place_state(gm: GraphModule, ctx: PassContext, decisions: dict[Node, Decision], placements,
                 degree: int) -> None:
    """Parameters and buffers take the placement their consumers need, so they are sliced at load time; so does a
    squeeze of one (a 1x1 convolution's weight read as a linear's, ``pointwise_convs``), and its parameter the
    placement the squeeze maps onto it."""
    state = {node for node, graph_input in ctx.placeholder_inputs(gm).items() if graph_input.is_model_tensor}
    for view in [n for n in gm.graph.nodes if n.target is aten.squeeze.dims and n.args[0] in state]:
        wanted, (source,) = _wanted(view, decisions), view.all_input_nodes
        if not is_sharded(wanted):
            continue
        rule = rule_for(view)
        for dim in range(len(shape_of(source))):
            if rule(view, {source: with_dim(wanted, dim)}, degree).output == wanted:
                placements[view] = decisions[view].output = wanted
                decisions[view].inputs[source] = with_dim(wanted, dim)
                break
    for node in state:
        wanted = _wanted(node, decisions)
        if wanted is not None:
            placements[node] = wanted


def _decided(linear: Node, decision: Decision, roles: LinearRoles, degree: int, gathered: bool) -> LinearSharding:
    if isinstance(decision.output, Partial):
        return LinearSharding(Style.ROWWISE, gathered=gathered)
    if is_sharded(decision.output) and linear in roles.colwise:
        widths = shard_widths(decision.output, shape_of(linear)[-1], degree)
        return LinearSharding(Style.COLWISE, roles.packed.get(linear), unit_of(decision.output),
                              (min(widths), max(widths)), gathered)
    return LinearSharding(Style.REPLICATE, gathered=gathered)


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    degree = ctx.mesh.size(AXIS)
    too_many = degree_above_heads(ctx.attention, degree)
    if too_many is not None:
        raise too_many
    fqns = {node: gi.target for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    paths = {linear: linear_path(linear, fqns) for linear in linears}
    forced = _match_overrides(paths, ctx.plan)
    for linear, path in paths.items():
        blocks = ctx.packed_overrides.get(path)
        if blocks is not None and sum(blocks) != shape_of(linear)[-1]:
            raise PartitionError(f"plan entry {path!r}: packed blocks {list(blocks)} do not add up to the Linear's "
                                 f"{shape_of(linear)[-1]} output features; plan again for this model")
    roles, gathered, reasons = LinearRoles(), set(), {}
    if degree > 1:  # at degree 1 nothing is sharded: the partition is the identity
        roles = LinearRoles(
            colwise={n for n in linears if forced.get(n, Style.COLWISE) is Style.COLWISE},
            rowwise={n for n, s in forced.items() if s is Style.ROWWISE},
            replicate={n for n, s in forced.items() if s is Style.REPLICATE},
            forced=set(forced),
            packed={node: ctx.packed_overrides[path] for node, path in paths.items() if path in ctx.packed_overrides},
            units={node: ctx.unit_overrides[path] for node, path in paths.items() if path in ctx.unit_overrides})
        while True:
            sweep = _propagate(gm, roles, gathered, degree)
            failed = sweep.failed or _low_rank_branches(sweep, roles)
            reasons.update(failed)
            roles.colwise -= set(failed)
            new_packing = {n: b for n, b in sweep.packing.items() if roles.packed.get(n) != b}
            roles.packed.update(new_packing)
            roles.units.update(sweep.units)
            new_gathered = sweep.failed_forced - gathered
            gathered |= new_gathered
            if not (failed or new_packing or sweep.units or new_gathered):
                break
        for linear in linears:
            if (linear not in forced and sweep.decisions[linear].output == R
                    and not is_sharded(sweep.placements[linear.args[0]]) and _cheap_rowwise(linear, degree)):
                roles.rowwise.add(linear)
    sweep = _propagate(gm, roles, gathered, degree)
    _place_state(gm, ctx, sweep.decisions, sweep.placements, degree)

    for node in gm.graph.nodes:
        annotation(node).placements = {AXIS: sweep.placements.get(node)}
        annotation(node).required = {AXIS: sweep.decisions[node].inputs} if node in sweep.decisions else {AXIS: {}}
    for linear in linears:
        decided = _decided(linear, sweep.decisions[linear], roles, degree, linear in gathered)
        ctx.linear_styles[paths[linear]] = decided
        if linear in reasons:
            ctx.replicated_because[paths[linear]] = reasons[linear]
        path = paths[linear]
        if (degree > 1 and linear in forced and (path in ctx.unit_overrides or path in ctx.packed_overrides)
                and decided.style is not forced[linear]):
            raise PartitionError(f"plan entry {path!r}: {forced[linear]} in the plan's units or blocks cannot be "
                                 f"applied (it would be {decided}: {reasons.get(linear, 'the sharding does not divide')})"
                                 "; plan again for this model and mesh")
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every node has a placement per axis and every input requirement names a real input."""
    for node in gm.graph.nodes:
        if AXIS not in (annotation(node).placements or {}):
            raise InvariantError(f"{node.name} has no placement")
        for producer in annotation(node).required[AXIS]:
            if producer not in node.all_input_nodes:
                raise InvariantError(f"{node.name} requires a placement of {producer.name}, which it does not use")


def warn_unsplit_linears(ctx: PassContext, stacklevel: int = 3) -> None:
    """One ``PartitionWarning`` when the tensor axis splits none of the model's Linears: every rank holds and runs
    them all, which is exact and no parallelism (``partition`` and ``plan`` call this)."""
    import warnings

    from ..errors import PartitionWarning

    if AXIS not in ctx.mesh.axis_names or ctx.mesh.size(AXIS) <= 1 or not ctx.linear_styles:
        return
    if all(decided.style is Style.REPLICATE for decided in ctx.linear_styles.values()):
        first = next(iter(ctx.linear_styles))
        warnings.warn(f"{AXIS}={ctx.mesh.size(AXIS)} splits none of the {len(ctx.linear_styles)} Linears of this "
                      f"model: every rank holds and runs them all (the result is exact). explain({first!r}) says "
                      "why; drop the axis or report the model", PartitionWarning, stacklevel=stacklevel)
