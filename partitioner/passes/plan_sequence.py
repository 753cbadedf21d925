"""plan_sequence: sequence parallelism over the "ring" and "ulysses" mesh axes, decided from the graph's structure.

Requires: plan_sharding has run (the tp placements: a Ulysses exchange splits the heads a tp rank holds).
Guarantees: every node carries ``meta["placements"][axis]`` and ``meta["required"][axis]`` for each sequence axis
of the mesh. Each axis is planned on its own, in mesh order (ring, then ulysses: USP, Ulysses inside each ring
group); they differ only in their attention rule: Ulysses exchanges q/k/v to head sharding and back, ring attention
keeps every rank's rows and sends key/value blocks round the ring (``rules/attention.py``).

How the plan is found:

1. The sequence lengths are those of the self-attentions (query length == key length); in a model whose only
   attentions are cross-attentions, those of their queries.
2. Candidates: every user input and op result that feeds an attention and has exactly one dim of such a length;
   each is offered sharded along that dim. Where a candidate's own result is replicated it is sliced, for free.
3. Placements propagate with the sequence-axis rules (linears and norms act row by row; Ulysses attention
   exchanges q/k/v to head sharding with all_to_all and its output back). A candidate whose sharding reaches,
   *before an attention*, an op that cannot carry it is dropped and the sweep reruns: for MiniMax-H3 that is the
   ``index_copy`` scatter that builds the packed sequence from sequence-wide indices, so the sequence is sharded
   once it is built, and the per-row values (AdaLN row indices, rotary angles, norm_out's timestep indices) are
   sliced at their source, without communication.
   A joint sequence concatenated from parts (an MMDiT's text and image rows) is sharded part by part: the joint
   value is a packed shard, exchanged around attention in rank order (attention does not see the permutation)
   and split back into its parts without communication. Only on DeviceMesh partitions (see ``run``).
4. *After* the last attention such an op gets the sequence gathered just before it: as late as possible, so it
   moves the fewest bytes (for H3 after the output heads, before the ``index_select`` of video and audio rows).
"""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node

from ..context import PassContext
from ..mesh import SEQUENCE_AXES
from ..placement import Replicate, Shard, any_sharded
from ..propagate import sweep
from ..errors import InvariantError, PartitionError, PartitionWarning
from ..rules import Decision, NeedsPacking, NeedsUnit, Unshardable, rule_for, shape_of
from ..rules.attention import RING_AXES
from ..rules.pointwise import SIZE_ARGUMENT
from ..rules.views import slice_bounds

R = Replicate()


def sequence_lengths(gm: GraphModule, attentions: list[Node], parts: bool = True
                      ) -> tuple[set[int], set[int], set[int]]:
    """All sequence lengths, the lengths of the parts a joint sequence is concatenated from (text and image rows of
    an MMDiT) that are no attention's own, and the joint lengths: each part is offered sharded on its own, so the
    joint sequence is a packed shard whose blocks split back into the parts without communication."""
    lengths = set()
    for node in attentions:
        q, k = shape_of(node.args[0]), shape_of(node.args[1])
        if len(q) == 4 and q[2] == k[2]:
            lengths.add(q[2])
    if not lengths:  # only cross-attentions (Sana's self-attention is linear attention): their query rows
        lengths = {shape_of(node.args[0])[2] for node in attentions if len(shape_of(node.args[0])) == 4}
    joint, own = set(), set(lengths)
    for _ in range(2 if parts else 0):  # a part may itself be concatenated
        for node in gm.graph.nodes:
            found = _joined(node)
            # (a sequence is never the last dim: a cat there joins features, e.g. rotary frequencies)
            if found and shape_of(node)[found[0]] in lengths and found[0] != len(shape_of(node)) - 1:
                joint.add(shape_of(node)[found[0]])
                lengths |= found[1]
    return lengths, lengths - own, joint


def _joined(node: Node) -> tuple[int, set[int]] | None:
    """The dim and the part lengths of a sequence joined from parts: a cat of several values, or rows written
    into a buffer (``joint[:, :text] = text; joint[:, text:] = image``: the rows before, written and after)."""
    shape = shape_of(node)
    if not shape:
        return None
    if node.target is torch.ops.aten.cat.default and len(node.args[0]) > 1:
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape)
        parts = {shape_of(part)[dim] for part in node.args[0] if shape_of(part)}
        return (dim, parts) if 0 not in parts else None
    if node.target is torch.ops.aten.slice_scatter.default:
        dim = (node.args[2] if len(node.args) > 2 else 0) % len(shape)
        bounds = slice_bounds(node, shape[dim], dim_arg=2)
        if bounds and bounds != (0, shape[dim]):
            start, end = bounds
            return dim, {size for size in (start, end - start, shape[dim] - end) if size}
    return None


def ancestors(nodes: list[Node]) -> set[Node]:
    """Every node some node of ``nodes`` reads, directly or not."""
    seen, stack = set(), [n for node in nodes for n in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _candidates(gm: GraphModule, ctx: PassContext, lengths: set[int], parts: set[int],
                feeds_attention: set[Node]) -> dict:
    """Values offered sharded along their sequence dim: node -> dim."""
    model_tensors = {node for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    candidates = {}
    for node in feeds_attention - model_tensors:
        shape = shape_of(node) or ()
        for tier in (lengths - parts, parts):  # an attention's own length first, then a part of a joint one
            dims = [d for d, size in enumerate(shape) if size in tier]
            if dims:
                if len(dims) == 1:
                    candidates[node] = dims[0]
                break
    return candidates


def _propagate(gm: GraphModule, axis: str, seeds: dict[Node, int], feeds_attention: set[Node], ctx: PassContext,
               refused: dict[Node, str], joint: set[int], feeds_length: dict[int, set[Node]], gathered: set[Node]):
    """One sweep (``partitioner.propagate``): decisions, the seeds that failed before an attention (with why), and
    the values to gather once their own attentions are done.
    A seed's consumers see it sequence-sharded (sliced for free where it is computed whole). An attention that
    refuses its sequence-sharded inputs is recorded in ``refused``; after the last attention a refusal just gathers
    the sequence back. So does a refusal after the last attention *of the length a seed shards* (``feeds_length``:
    length -> the attentions of that query length and what they read): the value reaching it is gathered right
    where it is made (``gathered``), its own attention having run sharded (H3's text refiner, whose rows are then
    packed into the main sequence by index)."""
    def adjust(node: Node, decision: Decision) -> Decision:
        if node in seeds and not any_sharded(decision.seen):
            if node.target in SIZE_ARGUMENT:  # a buffer (H3's packed sequence) is made at this rank's size
                decision.output = Shard(seeds[node])
            else:
                decision.visible = Shard(seeds[node])
        if node in gathered:
            decision.visible = R
        return decision

    swept = sweep(gm, lambda node: rule_for(node, sequence_axis=axis), ctx.mesh.size(axis), adjust=adjust,
                  is_seed=lambda node, decision: node in seeds)
    failed, to_gather = {}, set()
    for failure in swept.failures:
        problem = failure.problem
        if isinstance(problem, NeedsPacking):  # sequence shards are never packed
            problem = Unshardable(f"split into {list(problem.blocks)} rows along the sharded sequence")
        if isinstance(problem, NeedsUnit):  # nor split in units
            problem = Unshardable(f"regrouped in units of {problem.unit} rows along the sharded sequence")
        if failure.node.target is torch.ops.aten.scaled_dot_product_attention.default:
            refused[failure.node] = str(problem)
        if failure.node in feeds_attention:
            # a joint-length value sharded whole meets the packed parts: it gives way (it is sliced to them)
            whole = {s for s in failure.seeds if shape_of(s)[seeds[s]] in joint}
            culprits = whole if whole and whole != failure.seeds else failure.seeds
            # a value sharded along another length than the failing op's own gives way to the ones along it
            # (H3's text rows, whose own attention is not sharded, meet the packed rows gathered from them)
            other = {s for s in culprits if shape_of(s)[seeds[s]] not in (shape_of(failure.node) or ())}
            for seed in (other if other and other != culprits else culprits):
                done = _done_with(failure.node, seed, shape_of(seed)[seeds[seed]], feeds_length, swept.visible)
                if done:
                    to_gather |= done
                else:
                    failed.setdefault(seed, f"{failure.node.name}: {problem}")
    parts = {s: r for s, r in failed.items() if shape_of(s)[seeds[s]] not in joint}
    if parts and len(parts) < len(failed):  # drop failing parts first: a whole joint value may work without them
        failed = parts
    if failed:  # seeds dropped first; what their dropping leaves to gather is found again
        to_gather = set()
    return swept.decisions, failed, to_gather


def _done_with(node: Node, seed: Node, length: int, feeds_length: dict[int, set[Node]], visible) -> set[Node]:
    """The inputs of ``node`` sharded along ``length`` when ``seed`` reaches an attention of that length and
    ``node`` comes after all of them: gathering those inputs serves ``node`` and keeps the attentions sharded.
    Empty when the seed must be dropped instead, or when such an input still feeds an attention of that length
    (gathered, every consumer would see it whole)."""
    own = feeds_length.get(length, set())
    if seed not in own or node in own:
        return set()
    inputs = {n for n in node.all_input_nodes if any_sharded(visible.get(n, R))
              and (shape_of(n) or ())[getattr(visible[n], "dim", 0)] == length}
    return set() if inputs & own else inputs


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    first = True
    for axis in [axis for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES]:
        _plan_axis(gm, ctx, axis, joint_parts=first)
        first = first and ctx.mesh.size(axis) <= 1
    return gm


def _plan_axis(gm: GraphModule, ctx: PassContext, axis: str, joint_parts: bool) -> None:
    """Plan one sequence axis. A joint sequence is packed from its parts only on the first axis that shards:
    packed blocks name global sizes, which an inner axis (Ulysses inside a ring shard) does not split."""
    attentions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    seeds: dict[Node, int] = {}
    feeds_attention = ancestors(attentions) | set(attentions)
    # Packed joint sequences are exchanged by this package's own collectives; the XLA backend (meshes given as
    # axis sizes, one process driving every device) lets XLA place collectives and does not lay them out yet.
    lengths, parts, joint = sequence_lengths(gm, attentions, parts=ctx.mesh.runnable and joint_parts)
    small = {size for size in parts if size < ctx.mesh.size(axis)}  # (a register token: no rows for some ranks)
    lengths, parts = lengths - small, parts - small
    given = (ctx.given_sequence_seeds_by_axis or {}).get(axis, ctx.given_sequence_seeds)
    if ctx.mesh.size(axis) > 1:
        seeds = (_given_seeds(gm, given) if given is not None
                 else _candidates(gm, ctx, lengths, parts, feeds_attention))
    refused: dict[Node, str] = {}
    stopped: dict[str, str] = {}  # this axis's seeds that were given up, and why
    # (Only on DeviceMesh partitions: XLA's equal tiles would refuse a ring over a short text of any length.)
    by_length: dict[int, list[Node]] = {}
    for attention in attentions if ctx.mesh.runnable else ():
        by_length.setdefault(shape_of(attention.args[0])[2], []).append(attention)
    feeds_length = {length: ancestors(nodes) | set(nodes) for length, nodes in by_length.items()}
    gathered: set[Node] = set()
    while True:
        decisions, failed, to_gather = _propagate(gm, axis, seeds, feeds_attention, ctx, refused, joint,
                                                  feeds_length, gathered)
        if failed and given is not None:
            raise PartitionError(f"the plan's sequence sharding over {axis!r} cannot be applied: "
                                 + "; ".join(f"{seed.name}: {reason}" for seed, reason in failed.items()))
        for seed, reason in failed.items():
            stopped[seed.name] = reason
            del seeds[seed]
        if not failed and to_gather <= gathered:
            break
        gathered |= to_gather
    ctx.sequence_stopped.update(stopped)
    ctx.sequence_seeds = {node.name: dim for node, dim in seeds.items()}
    if ctx.mesh.size(axis) > 1:
        ctx.sequence_seeds_by_axis[axis] = dict(ctx.sequence_seeds)
    _record_attentions(attentions, decisions, refused, ctx, axis, stopped)
    for node in gm.graph.nodes:
        node.meta["placements"][axis] = decisions[node].output
        node.meta["required"][axis] = decisions[node].inputs
    ctx.sequence_sharded_at = sorted(n.name for n, _ in seeds.items() if decisions[n].output == R)


def _given_seeds(gm: GraphModule, given: dict[str, int]) -> dict[Node, int]:
    """A plan's seeds, by value name; a name this graph does not have means the plan is for another model."""
    nodes = {node.name: node for node in gm.graph.nodes}
    missing = sorted(set(given) - set(nodes))
    if missing:
        raise PartitionError(f"the plan shards values this model's graph does not have: {missing[:5]}; plan again "
                             "for this model and these example input shapes")
    return {nodes[name]: dim for name, dim in given.items()}


def _record_attentions(attentions: list[Node], decisions: dict, refused: dict[Node, str], ctx: PassContext,
                       axis: str, stopped: dict[str, str]) -> None:
    """Which attentions are sequence-sharded over ``axis``, and why the others are not (``Partitioned.explain``;
    with two sequence axes each line names its axis). An attention too short or with too few heads for the degree
    is left whole; a ulysses degree that shards no attention warns, a ring that shards none is refused."""
    if ctx.mesh.size(axis) <= 1:
        return
    found = {}
    for node in attentions:
        info = node.meta.get("heads")
        where = info.module if info is not None else node.name
        decision = decisions[node]
        if decision.output == Shard(1):  # runs on a head shard: q, k and v were exchanged to it
            found[where] = "sequence-sharded (Ulysses all_to_all)"
        elif getattr(decision.output, "dim", None) == 2 and any_sharded(decision.inputs.get(node.args[1], R)):
            found[where] = "sequence-sharded (ring attention: key/value blocks passed round the ring)"
        elif getattr(decision.output, "dim", None) == 2:  # this rank's query rows over whole keys, values
            found[where] = "sequence-sharded (query rows; keys and values whole, no communication)"
        elif node in refused:
            found[where] = f"not sequence-sharded: {refused[node]}"
        else:
            why = sorted(stopped[n.name] for n in ancestors([node]) if n.name in stopped)
            found[where] = ("not sequence-sharded: its query, key and value reach it whole"
                            + (f" (sharding stopped at {why[0]})" if why else
                               " (no input of it has the sequence length)"))
    several = sum(ctx.mesh.size(a) > 1 for a in ctx.mesh.axis_names if a in SEQUENCE_AXES) > 1
    for where, how in found.items():
        if several:
            how = "; ".join(filter(None, [ctx.sequence_attention.get(where), f"{axis}: {how}"]))
        ctx.sequence_attention[where] = how
    if attentions and not any(how.startswith("sequence-sharded") for how in found.values()):
        reasons = sorted({how.removeprefix("not sequence-sharded: ") for how in found.values()})
        if axis in RING_AXES:
            raise PartitionError(f"a ring of {ctx.mesh.size(axis)} shards no attention of this model: "
                                 + "; ".join(reasons[:4]) + "; use a smaller ring degree (at most the shortest "
                                 "sequence) or drop the ring axis")
        warnings.warn(f"a {axis} degree of {ctx.mesh.size(axis)} shards no attention of this model, so its ranks "
                      "repeat the same attention work (the result is exact): " + "; ".join(reasons[:4])
                      + f"; use a smaller {axis} degree or drop the {axis} axis", PartitionWarning, stacklevel=2)


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every node has a placement for each sequence axis of the mesh."""
    for axis in [axis for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES]:
        for node in gm.graph.nodes:
            if axis not in node.meta["placements"]:
                raise InvariantError(f"{node.name} has no {axis} placement")
