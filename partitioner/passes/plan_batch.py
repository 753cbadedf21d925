"""plan_batch: data parallelism over a "dp" mesh axis (alias "cfg", for classifier-free guidance's two batches).

Requires: plan_sequence has run (every node has its tp and ulysses placements; this pass adds the batch axis).
Guarantees: every node carries ``annotation.placements[axis]`` and ``annotation.required[axis]``; the batch is split
where it enters and gathered only at the outputs.

The batch is dim 0 of the model's first output. Every user input whose dim 0 has that size is offered split along
it (each rank slices its rows of the whole input, for free); the split follows the ops that treat batch rows one
by one (the same rules as a sequence shard: linears, norms, attention per batch row). An input whose split reaches
an op that mixes batch rows is dropped and the sweep reruns, so inside the graph nothing is exchanged; the outputs
are gathered along the batch. ``ctx.batch_split`` names the inputs split and why the others are not.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from ..decisions import BatchSplit
from ..errors import InvariantError, PartitionError
from ..mesh import BATCH_AXES
from ..placement import Shard, any_sharded
from ..rules import Decision, rule_for, shape_of
from ..rules.propagate import sweep
from .context import PassContext
from ..annotations import annotation


def batch_axis(ctx: PassContext) -> str | None:
    return next((name for name in ctx.mesh.axis_names if name in BATCH_AXES), None)


def _batch_size(gm: GraphModule) -> tuple[int, str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for value in output.all_input_nodes:
        shape = shape_of(value)
        if shape:
            return shape[0], value.name
    raise PartitionError("a batch axis splits dim 0 of the model's outputs, and this model returns no tensor")


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    axis = batch_axis(ctx)
    if axis is None:
        return gm
    degree = ctx.mesh.size(axis)
    seeds: dict[Node, int] = {}
    if degree > 1 and ctx.mesh.pairs_calls:  # its halves run other calls: every value replicated over it
        ctx.batch_split.update({node.name: BatchSplit(False, "the cfg axis runs guidance calls in pairs (cfg='pairs')")
                                for node, gi in ctx.placeholder_inputs(gm).items() if gi.kind == "user"})
        degree = 1
    if degree > 1:
        batch, output = _batch_size(gm)
        if batch < degree:
            raise PartitionError(f"a {axis} degree of {degree} splits the batch, and this call's batch is {batch} "
                                 f"(dim 0 of the output {output}): call with a batch of at least {degree} (e.g. the "
                                 f"conditional and unconditional halves of classifier-free guidance), or drop {axis}")
        seeds = {node: 0 for node, gi in ctx.placeholder_inputs(gm).items()
                 if gi.kind in ("user", "host") and (shape_of(node) or (0,))[0] == batch and len(shape_of(node)) > 0}

    def adjust(node: Node, decision: Decision) -> Decision:
        if node in seeds and not any_sharded(decision.seen):
            decision.visible = Shard(0)  # each rank slices its rows of the whole input
        return decision

    while True:
        swept = sweep(gm, lambda node: rule_for(node, sequence_axis=axis), degree, adjust=adjust,
                      is_seed=lambda node, decision: node in seeds)
        dropped = {seed: f"{failure.node.name} ({failure.node.target}): {failure.problem}"
                   for failure in swept.failures if failure.node.op != "output"  # outputs are gathered
                   for seed in failure.seeds if seed in seeds}
        for seed, reason in dropped.items():
            ctx.batch_split[seed.name] = BatchSplit(False, reason)
            del seeds[seed]
        if not dropped:
            break
    if degree > 1 and not seeds:
        raise PartitionError(f"a {axis} degree of {degree} splits no input of this model along the batch: "
                             + "; ".join(f"{name}: {why}" for name, why in list(ctx.batch_split.items())[:3]))
    ctx.batch_split.update({seed.name: BatchSplit(True) for seed in seeds})
    for node in gm.graph.nodes:
        annotation(node).placements[axis] = swept.decisions[node].output
        annotation(node).required[axis] = swept.decisions[node].inputs
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: on a mesh with a batch axis, every node has a placement on it."""
    axis = batch_axis(ctx)
    if axis is None:
        return
    for node in gm.graph.nodes:
        if axis not in annotation(node).placements:
            raise InvariantError(f"{node.name} has no {axis} placement")
