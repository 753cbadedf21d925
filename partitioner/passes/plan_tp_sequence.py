"""plan_tp_sequence: between the tensor-parallel regions, each tp rank keeps 1/tp of the rows instead of all of
them (Megatron's sequence parallelism, found from the graph's structure).

Requires: plan_batch has run (every axis placed).
Guarantees: where the cost model says it pays, a row-parallel linear's partial sum is reduce-scattered along its
sequence rows instead of all-reduced; the ops the tp plan left replicated that act row by row on it (residual adds,
norms, modulation, a replicated linear) then run on this rank's rows only; the rows are all-gathered where a
tensor-parallel op needs them whole (a column-parallel linear) or an op cannot carry them (the graph output). The tp
plan of every op it shards is unchanged. ``ctx.tp_sequence`` says what was decided and why, ``explain()`` shows it.

How:

1. Seeds: every partial sum over tp (a row-parallel linear's output) whose rows the graph shows (the dim that
   carries an attention's rows, ``partitioner.rules.sequence_dims``) is offered to its consumers sharded along them.
2. One sweep of ``partitioner.rules.propagate`` with the sequence-axis rules on the ops the tp plan left replicated; an op
   the tp plan shards keeps its decision and takes its inputs as the plan says (a row-sharded input it needs whole
   is gathered). A seed that reaches a sharded op needing its rows in another layout than whole is dropped and the
   sweep reruns. An attention the tp plan left whole is never row-sharded here (that would be Ulysses over tp).
3. The cost rule (``partitioner.planning.cost``, the overlap profile): the repeated work saved, each row-sharded op's time
   times (tp - 1) / tp, against the communication added, a reduce-scatter instead of each all_reduce and an
   all_gather for every value gathered (a reduce-scatter and an all-gather move what one all-reduce moves).
   The all_reduce they replace may hide behind compute (with overlap on it counts only the share the profile says
   compute cannot hide); the reduce-scatter and all-gather are scheduled alike, but the rows they carry are what
   the next ops need, so little compute is independent of them (none in H3's blocks): they count whole, an upper
   bound. Applied only when the saving is larger.

With a sequence axis (ulysses, ring) the rows are already split over it, and tp's row shard nests inside each of
its shards (``InnerShard``): gathering over tp then gives back what the sequence axis holds. Not in a plan for XLA's
global program (programs="global"): the XLA backend, which reads these placements, lets XLA place its own
collectives.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import GraphModule, Node

from ..placement import InnerShard, Partial, Replicate, Shard, any_sharded, is_sharded, local_shape
from ..planning.cost import collective_s, load_profile, node_compute_s
from ..planning.report import nbytes
from ..rules import Decision, Unshardable, rule_for, shape_of
from ..rules.attention import FLEX_ATTENTION
from ..rules.propagate import sweep
from ..rules.sequence_dims import find_sequence_dims
from . import plan_sharding
from .context import PassContext
from .plan_sequence import ancestors
from .plan_sharding import linear_paths
from ..annotations import annotation

AXIS = "tp"
R = Replicate()
_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def _replicated(placement) -> bool:
    members = placement if isinstance(placement, tuple) else (placement,)
    return all(p is None or p == R for p in members)


def _tp_sharded_nodes(gm: GraphModule) -> set[Node]:
    """The nodes the tp plan shards: a sharded or partial output, or an input needed other than whole."""
    return {node for node in gm.graph.nodes
            if not _replicated(annotation(node).placements[AXIS])
            or not all(map(_replicated, annotation(node).required[AXIS].values()))}


def _row_dim(node: Node, rows) -> int | None:
    """The dim that carries an attention's rows (``sequence_dims``), never the last (features: a bias is added
    along it)."""
    dim = rows.dim(node)
    return dim if dim is not None and dim != len(shape_of(node) or ()) - 1 else None


def _planned(node: Node) -> Decision:
    return Decision(annotation(node).placements[AXIS], dict(annotation(node).required[AXIS]))


def _propagate(gm: GraphModule, sharded: set[Node], seeds: dict[Node, int], degree: int):
    def keep_plan(node: Node, visible, axis_size: int) -> Decision:
        decision = _planned(node)
        for source, required in decision.inputs.items():
            rows = visible.get(source, R)
            if not any_sharded(rows) or required == R:
                continue  # (whole: all_gathered)
            # a plain shard of another dim: all_to_all (a replicated value's slice, H3's norm_out scaled by a
            # feature-sharded modulation); packed, partial or along the rows in mesh order: not exact
            if not (isinstance(rows, Shard) and isinstance(required, Shard) and required.dim != rows.dim):
                raise Unshardable(f"the tp plan needs {source.name} as {required}, not sharded along its rows")
        return decision

    planned_sharded = {node for node in sharded
                       if node not in seeds and not _replicated(annotation(node).placements[AXIS])}

    def row_local(node: Node):
        """The sequence-axis rule, refusing what no collective could deliver exactly: a value the tp plan shards
        (a gathered column shard) taken along rows, or rows packed from parts (a joint sequence's cat)."""
        rule = rule_for(node, sequence_axis=AXIS)

        def checked(node: Node, visible, axis_size: int) -> Decision:
            decision = rule(node, visible, axis_size)
            if any(any_sharded(decision.inputs.get(n, R)) for n in node.all_input_nodes if n in planned_sharded):
                raise Unshardable("reads a value the tp plan shards along its rows")
            outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
            if any(is_sharded(p) and not isinstance(p, Shard) for p in outputs):
                raise Unshardable("rows packed from parts")
            if _reshapes_nested_rows(node, decision, outputs):
                raise Unshardable("reshapes rows a sequence axis splits too")
            return decision
        return checked

    def whole_attention(node: Node, visible, axis_size: int) -> Decision:
        if any(any_sharded(visible.get(n, R)) for n in node.all_input_nodes):
            raise Unshardable("an attention the tp plan left whole reads every row")
        return _planned(node)

    def rule_of(node: Node):
        if node in sharded:
            return keep_plan
        if node.target in (_ATTENTION, FLEX_ATTENTION):
            return whole_attention
        return row_local(node)

    def adjust(node: Node, decision: Decision) -> Decision:
        if node in sharded:  # (also after a refusal: a sharded op always keeps the tp plan)
            # its consumers see a seed's rows sharded and anything else whole: what the tp plan gives them
            decision = _planned(node)
            decision.visible = Shard(seeds[node]) if node in seeds else R
        return decision

    return sweep(gm, rule_of, degree, adjust=adjust, is_seed=lambda node, decision: node in seeds)


def _reshapes_nested_rows(node: Node, decision: Decision, outputs) -> bool:
    """An op (a view splitting the rows into frames x height x width) that gives tp's row shard a dim of another
    size, where another axis splits those rows too: the rule judged the split for tp alone, but tp's rows nest
    inside the other axis's shard, so the sizes it checked are not this rank's."""
    sizes = {shape_of(node)[p.dim] for p in outputs if isinstance(p, Shard) and shape_of(node)}
    for source, placement in decision.inputs.items():
        if not isinstance(placement, Shard) or not shape_of(source):
            continue
        others = [required.get(source) for axis, required in annotation(node).required.items() if axis != AXIS]
        if any(is_sharded(p) and p.dim == placement.dim for p in others) and \
                sizes - {shape_of(source)[placement.dim]}:
            return True
    return False


def _redistributed(gm: GraphModule, decisions: dict, seeds: dict[Node, int], kind) -> set[Node]:
    """Values seen row-sharded by some consumer that needs them whole (``Replicate``: gathered) or sharded along
    another dim (``Shard``: exchanged). A seed that some consumer needs whole is all-reduced instead."""
    return {source for node in gm.graph.nodes if node.op != "placeholder"
            for source, required in decisions[node].inputs.items()
            if source not in seeds and any_sharded(decisions[source].seen) and isinstance(required, kind)
            and required != decisions[source].seen}


def _scattered(seeds: dict[Node, int], decisions: dict) -> list[Node]:
    """Seeds every consumer takes row-sharded: reduce-scattered (the others are all-reduced, then sliced)."""
    return [seed for seed in seeds
            if all(decisions[user].inputs.get(seed) == Shard(seeds[seed]) for user in seed.users)]


def _estimate(decisions: dict, sharded: set[Node], scattered: list[Node], gathered: set[Node], exchanged: set[Node],
              ctx: PassContext):
    """(seconds of repeated work saved, seconds of communication added, the profile's name) on rank 0's group."""
    profile = load_profile(ctx.overlap.profile_for(ctx.mesh.device_type))
    degree, groups = ctx.mesh.size(AXIS), ctx.mesh.groups(AXIS)
    first = dataclasses.replace(ctx.mesh, rank=0)  # every rank decides from the same figures (uneven rows differ)

    def share(node: Node) -> float:
        """The part of a value a tp group holds: the other axes (a sequence, a batch axis) split it already."""
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor) or not val.numel():
            return 1.0
        others = {axis: p for axis, p in annotation(node).placements.items() if axis != AXIS}
        return math.prod(local_shape(val.shape, others, first)) / val.numel()

    def comm(kind: str, node: Node, part: float = 1.0) -> float:
        return collective_s(kind, nbytes(node.meta["val"]) * share(node) * part, groups[0], groups, profile)

    saved = sum(node_compute_s(node, profile)[0] * share(node) for node, decision in decisions.items()
                if node not in sharded and any_sharded(decision.output)) * (degree - 1) / degree
    # an all_reduce may hide behind compute (chunk_reductions, schedule_collectives); the reduce_scatter and
    # all_gather that replace it carry rows the next ops need (little to hide behind): counted whole
    hidden = profile.overlap if ctx.overlap.schedule or ctx.overlap.chunk_reductions else 0.0
    added = sum(comm("reduce_scatter", seed) - (1 - hidden) * comm("all_reduce", seed) for seed in scattered)
    added += sum(comm("all_gather", node) for node in gathered)
    added += sum(comm("all_to_all", node, 1 / degree) for node in exchanged)
    return saved, added, profile.name


def _inner(placement, others: dict):
    """tp's row shard as it nests with the other axes' placements of the same value: split inside another axis's
    shard of the same dim (ulysses or ring rows), an ``InnerShard``."""
    if isinstance(placement, tuple):
        return tuple(_inner(p, {axis: o[i] if isinstance(o, tuple) else o for axis, o in others.items()})
                     for i, p in enumerate(placement))
    if isinstance(placement, Shard) and any(is_sharded(p) and p.dim == placement.dim
                                            for axis, p in others.items() if axis != AXIS):
        return InnerShard(placement.dim)
    return placement


def _rows_layout(tp, others: dict):
    """How a value's tp-sharded dim is split: tp's placement and the other axes that shard the same dim."""
    if not is_sharded(tp):
        return None
    return tp, tuple(axis for axis, p in others.items() if axis != AXIS and is_sharded(p) and p.dim == tp.dim)


@dataclasses.dataclass(frozen=True)
class _Mismatch:
    why: str
    source: Node  # the value taken split otherwise than it is made


def _nest(gm: GraphModule, decisions: dict, sharded: set[Node], seeds: dict[Node, int]):
    """The new tp placements of the replicated ops (output, input requirements), each row shard nested inside
    the sequence axes' shards of its rows; a ``_Mismatch`` where a value would be taken split otherwise than it
    is made over the same dim (a sequence axis gathering rows that tp keeps sharded, H3's refined text before it
    is packed): no collective here moves rows between two nestings."""
    nested = {}
    for node in gm.graph.nodes:
        if node in sharded or node.op == "placeholder":
            continue
        decision = decisions[node]
        required = annotation(node).required
        inputs = {source: _inner(p, {axis: wanted.get(source) for axis, wanted in required.items()})
                  for source, p in decision.inputs.items()}
        nested[node] = (_inner(decision.output, annotation(node).placements), inputs)
    for node, (_, inputs) in nested.items():
        for source, wanted in inputs.items():
            if not is_sharded(wanted):
                continue
            # a seed is reduce-scattered straight into the layout its consumers want, over its own other axes
            made = wanted if source in seeds else nested[source][0] if source in nested else None
            made_layout = _rows_layout(made, annotation(source).placements)
            wanted_layout = _rows_layout(wanted, {axis: r.get(source) for axis, r in annotation(node).required.items()})
            if made_layout is not None and made_layout != wanted_layout:
                return _Mismatch(f"{node.name} would take {source.name}'s rows split as {wanted_layout}, they are "
                                 f"split as {made_layout}", source)
    return nested


def _settle(gm: GraphModule, sharded: set[Node], seeds: dict[Node, int], degree: int):
    """The seeds whose rows every tp-sharded op they reach takes as they come (the others dropped, sweep by sweep),
    and their last sweep."""
    while True:
        swept = _propagate(gm, sharded, seeds, degree)
        dropped = {seed for failure in swept.failures if failure.node in sharded for seed in failure.seeds}
        if not dropped:
            return seeds, swept
        seeds = {seed: dim for seed, dim in seeds.items() if seed not in dropped}


def _skipped(ctx: PassContext) -> str | None:
    """Why the rows stay whole on every tp rank, before looking at the graph."""
    if ctx.mesh.size(AXIS) <= 1:
        return "no tp axis"
    if not ctx.overlap.tp_sequence:
        return "switched off (overlap={'tp_sequence': False})"
    if not ctx.mesh.per_rank:
        return "not for XLA's global program (programs='global'): XLA places its own collectives"
    return None


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    skipped = _skipped(ctx)
    if skipped:
        ctx.tp_sequence = f"rows whole on every tp rank: {skipped}"
        return gm
    model_tensors = {node for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    rows = find_sequence_dims(gm, lambda node: rule_for(node, sequence_axis="ulysses"),
                              skip=model_tensors.__contains__)
    sharded = _tp_sharded_nodes(gm)
    seeds = {node: dim for node in gm.graph.nodes if isinstance(annotation(node).placements[AXIS], Partial)
             and (dim := _row_dim(node, rows)) is not None}
    while True:
        seeds, swept = _settle(gm, sharded, seeds, ctx.mesh.size(AXIS))
        if not seeds:
            ctx.tp_sequence = "rows whole on every tp rank: no partial sum over tp has exactly one sequence-long dim"
            return gm
        scattered = _scattered(seeds, swept.decisions)
        gathered = _redistributed(gm, swept.decisions, seeds, Replicate)
        exchanged = _redistributed(gm, swept.decisions, seeds, Shard)
        saved, added, profile = _estimate(swept.decisions, sharded, scattered, gathered, exchanged, ctx)
        figures = (f"{saved * 1e3:.3g} ms of repeated work saved against {added * 1e3:+.3g} ms of communication "
                   f"(profile {profile})")
        if saved <= added:
            ctx.tp_sequence = f"rows whole on every tp rank: the cost model estimates {figures}"
            return gm
        nested = _nest(gm, swept.decisions, sharded, seeds)
        if not isinstance(nested, _Mismatch):
            break
        # the seeds upstream of the mismatch keep their rows whole; the others may still pay
        upstream = ancestors([nested.source]) | {nested.source}
        if not upstream & set(seeds):
            ctx.tp_sequence = f"rows whole on every tp rank: {nested.why}"
            return gm
        seeds = {seed: dim for seed, dim in seeds.items() if seed not in upstream}
    for node, (output, inputs) in nested.items():
        annotation(node).placements[AXIS], annotation(node).required[AXIS] = output, inputs
    paths = linear_paths(gm, ctx)
    for seed in scattered:
        ctx.reduce_scattered[paths[seed]] = f"reduce-scattered along dim {seeds[seed]} (its rows)"
    ctx.tp_sequence = (f"rows sharded over tp: {len(scattered)} partial sums reduce-scattered, "
                       f"{len(gathered)} values all-gathered; {figures}")
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: plan_sharding's, still (every node has a tp placement, its requirements name its inputs)."""
    plan_sharding.check(gm, ctx)
