"""plan_sequence: Ulysses sequence parallelism over the "ulysses" mesh axis, decided from the graph's structure.

Requires: plan_sharding has run (the tp placements: a Ulysses exchange splits the heads a tp rank holds).
Guarantees: every node carries ``meta["placements"]["ulysses"]`` and ``meta["required"]["ulysses"]``.

How the plan is found:

1. The sequence lengths are those of the self-attentions (query length == key length).
2. Candidates: every user input and op result that feeds an attention and has exactly one dim of such a length;
   each is offered sharded along that dim. Where a candidate's own result is replicated it is sliced, for free.
3. Placements propagate with the sequence-axis rules (linears and norms act row by row; Ulysses attention
   exchanges q/k/v to head sharding with all_to_all and its output back). A candidate whose sharding reaches,
   *before an attention*, an op that cannot carry it is dropped and the sweep reruns: for MiniMax-H3 that is the
   ``index_copy`` scatter that builds the packed sequence from sequence-wide indices, so the sequence is sharded
   once it is built, and the per-row values (AdaLN row indices, rotary angles, norm_out's timestep indices) are
   sliced at their source, without communication.
4. *After* the last attention such an op gets the sequence gathered just before it: as late as possible, so it
   moves the fewest bytes (for H3 after the output heads, before the ``index_select`` of video and audio rows).
"""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node

from ..context import PassContext
from ..placement import Partial, Replicate, Shard, any_sharded
from ..errors import PartitionWarning
from ..rules import Decision, NeedsPacking, Unshardable, replicate_all, rule_for, shape_of

AXIS = "ulysses"
R = Replicate()


def _sequence_lengths(attentions: list[Node]) -> set[int]:
    lengths = set()
    for node in attentions:
        q, k = shape_of(node.args[0]), shape_of(node.args[1])
        if len(q) == 4 and q[2] == k[2]:
            lengths.add(q[2])
    return lengths


def _ancestors(nodes: list[Node]) -> set[Node]:
    seen, stack = set(), [n for node in nodes for n in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _candidates(gm: GraphModule, ctx: PassContext, lengths: set[int], feeds_attention: set[Node]) -> dict:
    """Values offered sharded along their sequence dim: node -> dim."""
    model_tensors = {node for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    candidates = {}
    for node in feeds_attention - model_tensors:
        shape = shape_of(node)
        dims = [d for d, size in enumerate(shape or ()) if size in lengths]
        if len(dims) == 1:
            candidates[node] = dims[0]
    return candidates


def _propagate(gm: GraphModule, seeds: dict[Node, int], feeds_attention: set[Node], ctx: PassContext,
               refused: dict[Node, str]):
    """One sweep: decisions, what each node's consumers see, and the seeds that failed (with why). An attention
    that refuses its sequence-sharded inputs is recorded in ``refused``."""
    degree = ctx.mesh.size(AXIS)
    decisions, visible, failed = {}, {}, {}
    provenance: dict[Node, frozenset] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            decision = Decision(R)
        else:
            try:
                decision = rule_for(node, sequence_axis=AXIS)(node, visible, degree)
            except (Unshardable, NeedsPacking) as problem:
                if isinstance(problem, NeedsPacking):  # sequence shards are never packed
                    problem = Unshardable(f"split into {list(problem.blocks)} rows along the sharded sequence")
                if node.target is torch.ops.aten.scaled_dot_product_attention.default:
                    refused[node] = str(problem)
                if node in feeds_attention:
                    implicated = frozenset().union(*(provenance.get(n, frozenset()) for n in node.all_input_nodes))
                    for seed in implicated:
                        failed.setdefault(seed, f"{node.name}: {problem}")
                decision = replicate_all(node, visible)  # after the last attention: gather the sequence back
        decisions[node] = decision
        shown = decision.visible if decision.visible is not None else decision.output
        if node in seeds and not any_sharded(shown):
            shown = Shard(seeds[node])
        visible[node] = shown
        if node in seeds:
            provenance[node] = frozenset({node})
        elif not isinstance(shown, Partial):
            carried = [provenance[n] for n in node.all_input_nodes
                       if n in provenance and any_sharded(visible[n]) and any_sharded(decision.inputs.get(n, R))]
            if carried:
                provenance[node] = frozenset().union(*carried)
    return decisions, failed


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if AXIS not in ctx.mesh.axis_names:
        return gm
    attentions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    seeds: dict[Node, int] = {}
    feeds_attention = _ancestors(attentions) | set(attentions)
    if ctx.mesh.size(AXIS) > 1:
        seeds = _candidates(gm, ctx, _sequence_lengths(attentions), feeds_attention)
    refused: dict[Node, str] = {}
    while True:
        decisions, failed = _propagate(gm, seeds, feeds_attention, ctx, refused)
        for seed, reason in failed.items():
            ctx.sequence_stopped[seed.name] = reason
            del seeds[seed]
        if not failed:
            break
    _record_attentions(attentions, decisions, refused, ctx)
    for node in gm.graph.nodes:
        node.meta["placements"][AXIS] = decisions[node].output
        node.meta["required"][AXIS] = decisions[node].inputs
    ctx.sequence_sharded_at = sorted(n.name for n, _ in seeds.items() if decisions[n].output == R)
    check(gm)
    return gm


def _record_attentions(attentions: list[Node], decisions: dict, refused: dict[Node, str], ctx: PassContext) -> None:
    """Which attentions are sequence-sharded, and why the others are not (``Partitioned.explain``). An attention
    too short or with too few heads for the degree is left whole; a degree that shards no attention warns."""
    if ctx.mesh.size(AXIS) <= 1:
        return
    for node in attentions:
        info = node.meta.get("heads")
        where = info.module if info is not None else node.name
        if decisions[node].visible is not None:
            ctx.sequence_attention[where] = "sequence-sharded (Ulysses all_to_all)"
        elif node in refused:
            ctx.sequence_attention[where] = f"not sequence-sharded: {refused[node]}"
        else:
            stopped = sorted(ctx.sequence_stopped[n.name] for n in _ancestors([node]) if n.name in ctx.sequence_stopped)
            ctx.sequence_attention[where] = ("not sequence-sharded: its query, key and value reach it whole"
                                             + (f" (sharding stopped at {stopped[0]})" if stopped else
                                                " (no input of it has the sequence length)"))
    if attentions and not any(v.startswith("sequence-sharded") for v in ctx.sequence_attention.values()):
        reasons = sorted({reason.removeprefix("not sequence-sharded: ") for reason in ctx.sequence_attention.values()})
        warnings.warn(f"a {AXIS} degree of {ctx.mesh.size(AXIS)} shards no attention of this model, so its ranks "
                      "repeat the same attention work (the result is exact): " + "; ".join(reasons[:4])
                      + f"; use a smaller {AXIS} degree or drop the {AXIS} axis", PartitionWarning, stacklevel=2)


def check(gm: GraphModule) -> None:
    """Postcondition: every node has a ulysses placement."""
    for node in gm.graph.nodes:
        if AXIS not in node.meta["placements"]:
            raise AssertionError(f"{node.name} has no {AXIS} placement")
