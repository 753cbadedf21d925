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

import itertools
import math
import re
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ..decisions import LinearSharding, Style
from ..errors import InvariantError, PartitionError, did_you_mean
from ..placement import Partial, Replicate, any_sharded, block_offsets, is_sharded, shard_widths, unit_of
from ..rules import Decision, LinearRoles, NeedsPacking, NeedsUnit, Unshardable, rule_for, shape_of
from ..rules.core import with_dim
from ..rules.propagate import sweep
from ..rules.views import degree_above_heads
from .context import PassContext
from .matmul_as_linear import weight_expressions
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


def linear_paths(gm: GraphModule, ctx: PassContext, weights: set[Node] | None = None) -> dict[Node, str]:
    """Each Linear's module path, the key of its decision: its weight's module (the parameter's FQN without its last
    name; a weight computed from model tensors, a 1x1 convolution's squeezed or a quantised one's parts: the one
    parameter they belong to), or the node's name for a weight that is no model tensor's. Linears of one module
    that read other weights (``x @ self.w1`` then ``@ self.w2``; chunks of one fused parameter) are told apart by
    the parameter's FQN, then by their order; one module called twice keeps one path (one weight, one decision)."""
    fqns = {node: gi.model_name for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    weights = weight_expressions(gm, ctx) if weights is None else weights
    keys = {n: _expression_key(n.args[1], fqns, weights) for n in gm.graph.nodes if n.target is aten.linear.default}
    owners = {linear: _owner(key) for linear, key in keys.items()}
    paths = {linear: owner.rsplit(".", 1)[0] if owner else linear.name for linear, owner in owners.items()}
    for path in set(paths.values()):
        # (a weight that is no model tensor's keeps its node's name, even where it is a module's path)
        group = [linear for linear in keys if paths[linear] == path and owners[linear] is not None]
        distinct = list(dict.fromkeys(keys[linear] for linear in group))
        if len(distinct) < 2:
            continue
        named = {key: _owner(key) for key in distinct}
        for linear in group:
            owner = named[keys[linear]]
            same = [key for key in distinct if named[key] == owner]
            paths[linear] = owner if len(same) == 1 else f"{owner}[{same.index(keys[linear])}]"
    return paths


def _expression_key(node: Node, fqns: dict[Node, str], weights: set[Node]) -> tuple | None:
    """What a weight is, independent of node names: ``("tensor", fqn)`` for a model tensor, ``(op, arguments)`` for
    the ops that compute it from model tensors (constant arguments as ``("constant", repr)``); None for a value
    that is not a weight."""
    if node in fqns:
        return ("tensor", fqns[node])
    if node not in weights:
        return None

    def argument(value):
        if isinstance(value, Node):
            return _expression_key(value, fqns, weights)
        if isinstance(value, (list, tuple)):  # (a cat's list of weights)
            return ("list", tuple(argument(item) for item in value))
        return ("constant", repr(value))
    return (str(node.target), tuple(argument(a) for a in (*node.args, *sorted(node.kwargs.items()))))


def _owner(key: tuple | None) -> str | None:
    """The one model tensor a weight is computed from (None: none, or several)."""
    found, todo = set(), [key] if key is not None else []
    while todo:
        kind, rest = todo.pop()
        if kind == "tensor":
            found.add(rest)
        elif kind != "constant":  # an op's arguments, a list's items
            todo += [part for part in rest if isinstance(part, tuple) and len(part) == 2]
    return found.pop() if len(found) == 1 else None


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


_MOST_OFFERS = 256  # placements tried for one op's inputs (a cat of n weights has 3^n): past it, cut at run time


def _offers(node: Node, wanted, degree: int) -> Decision | None:
    """The decision of ``node`` (an op of a weight expression) that gives ``wanted`` from inputs placed as it
    requires them, with as many inputs sharded as can be (they are then cut at load time); None if none does
    within ``_MOST_OFFERS`` tries (the value is then cut where it is used, exact)."""
    rule, inputs = rule_for(node), [n for n in node.all_input_nodes if shape_of(n)]
    # (a dim of one broadcasts: never cut)
    choices = [[R, *(with_dim(wanted, dim) for dim, size in enumerate(shape_of(n)) if size > 1)] for n in inputs]
    best = None
    for offered in itertools.islice(itertools.product(*choices), _MOST_OFFERS):
        placements = dict(zip(inputs, offered))
        try:
            decision = rule(node, placements, degree)
        except (Unshardable, NeedsPacking, NeedsUnit):
            continue
        if decision.output != wanted or any(decision.inputs.get(n, R) != p for n, p in placements.items()):
            continue
        sharded = sum(is_sharded(p) for p in offered)
        if best is None or sharded > best[0]:
            best = (sharded, decision)
    return best[1] if best else None


def _place_state(gm: GraphModule, ctx: PassContext, weights: set[Node], decisions: dict[Node, Decision], placements,
                 degree: int) -> None:
    """Parameters and buffers take the placement their consumers need, so they are sliced at load time. So do
    the ops of a weight expression (computed from them alone, ``matmul_as_linear``: a quantised weight dequantised
    from its payload and scales, a 1x1 convolution's weight squeezed, ``pointwise_convs``), from the last back:
    each takes the placement its consumers need where its rule gives it from sharded inputs, which then need it."""
    for node in reversed([n for n in gm.graph.nodes if n in weights and n.op == "call_function"]):
        wanted = _wanted(node, decisions)
        if not is_sharded(wanted) or placements.get(node) == wanted:
            continue
        decision = _offers(node, wanted, degree)
        if decision is not None:
            placements[node], decisions[node] = wanted, decision
    for node in [n for n in weights if n.op == "placeholder"]:
        wanted = _wanted(node, decisions)
        if wanted is not None:
            placements[node] = wanted


def _whole_quantised(gm: GraphModule, ctx: PassContext, weights: set[Node]) -> dict[str, str]:
    """Quantised parameters (parts of a tensor subclass) none of whose parts is read as a Linear's weight (torchao's
    int8 dynamic-activation Linear is an ``_int_mm`` of quantised activations, not a product by a weight):
    parameter -> the ops reading them. They stay whole on every rank, exact and not split: said, never silent."""
    readers: dict[str, set[str]] = {}
    as_weight: set[str] = set()
    for node, graph_input in ctx.placeholder_inputs(gm).items():
        owner = graph_input.part_of
        if owner is None:
            continue
        found = readers.setdefault(owner, set())
        todo = [(node, user) for user in node.users]
        while todo:  # through the weight's own casts and views to the ops that read it with activations
            value, user = todo.pop()
            if user in weights:
                todo += [(user, reader) for reader in user.users]
            elif user.target is aten.linear.default and user.args[1] is value:
                as_weight.add(owner)
            else:
                found.add(str(user.target).removeprefix("aten.").removesuffix(".default"))
    return {owner: ", ".join(sorted(found)) for owner, found in readers.items() if owner not in as_weight}


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
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    weights = weight_expressions(gm, ctx)
    paths = linear_paths(gm, ctx, weights)
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
            for seed in new_packing:  # (a unit asked of the unpacked layout, a fused qkv's whole third, is moot)
                if paths[seed] not in ctx.unit_overrides:
                    roles.units.pop(seed, None)
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
    _place_state(gm, ctx, weights, sweep.decisions, sweep.placements, degree)
    if degree > 1:
        ctx.whole_quantised = _whole_quantised(gm, ctx, weights)

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
    them all, which is exact and no parallelism (``partition`` and ``plan`` call this); one when it cannot split
    some quantised weights."""
    import warnings

    from ..errors import PartitionWarning

    if AXIS not in ctx.mesh.axis_names or ctx.mesh.size(AXIS) <= 1:
        return
    if ctx.whole_quantised:
        first, readers = next(iter(ctx.whole_quantised.items()))
        warnings.warn(f"{AXIS}={ctx.mesh.size(AXIS)} cannot split {len(ctx.whole_quantised)} quantised weights "
                      f"(e.g. {first}, read by {readers}): no rule reads them as a Linear's, so every rank holds "
                      "them whole (the result is exact); explain() lists them. Quantised Linears split where they "
                      "are a matrix product by their dequantised weight (torchao's weight-only int8 and float8)",
                      PartitionWarning, stacklevel=stacklevel)
    if ctx.linear_styles and all(decided.style is Style.REPLICATE for decided in ctx.linear_styles.values()):
        first = next(iter(ctx.linear_styles))
        warnings.warn(f"{AXIS}={ctx.mesh.size(AXIS)} splits none of the {len(ctx.linear_styles)} Linears of this "
                      f"model: every rank holds and runs them all (the result is exact). explain({first!r}) says "
                      "why; drop the axis or report the model", PartitionWarning, stacklevel=stacklevel)
