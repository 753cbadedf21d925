"""plan_sequence: sequence parallelism over the "ring" and "ulysses" mesh axes, decided from the graph's structure.

Requires: plan_sharding has run (the tp placements: a Ulysses exchange splits the heads a tp rank holds).
Guarantees: every node carries ``annotation.placements[axis]`` and ``annotation.required[axis]`` for each sequence axis
of the mesh. Each axis is planned on its own, in mesh order (ring, then ulysses: USP, Ulysses inside each ring
group); they differ only in their attention rule: Ulysses exchanges q/k/v to head sharding and back, ring attention
keeps every rank's rows and sends key/value blocks round the ring (``rules/attention.py``).

How the plan is found:

1. Which dim of each value holds an attention's rows is read from the graph (``partitioner.rules.sequence_dims``: from
   every attention's q, k and v back to what they are computed from, through each op's own rule), never from
   sizes: a row count equal to a head count or a feature width changes nothing.
2. Candidates: every user input and op result that feeds an attention and has such a dim; each is offered sharded
   along it. Where a candidate's own result is replicated it is sliced, for free.
3. Placements propagate with the sequence-axis rules (linears and norms act row by row; Ulysses attention
   exchanges q/k/v to head sharding with all_to_all and its output back). A candidate whose sharding reaches,
   *before an attention*, an op that cannot carry it is dropped and the sweep reruns: for MiniMax-H3 that is the
   ``index_copy`` scatter that builds the packed sequence from sequence-wide indices, so the sequence is sharded
   once it is built, and the per-row values (AdaLN row indices, rotary angles, norm_out's timestep indices) are
   sliced at their source, without communication.
   A joint sequence joined from parts (an MMDiT's text and image rows) is sharded part by part, each part as
   evenly as it splits (333 text rows over 2 ranks: 167 + 166): the joint value is a packed shard, exchanged
   around attention in rank order (attention does not see the permutation) and split back into its parts without
   communication. Only for rank programs (see ``run``).
4. *After* the last attention such an op gets the sequence gathered just before it: as late as possible, so it
   moves the fewest bytes (for H3 after the output heads, before the ``index_select`` of video and audio rows).
"""

from __future__ import annotations

import math
import operator
import warnings

import torch
from torch.fx import GraphModule, Node

from ..decisions import AttentionSequence, AttentionSequencing, SequenceKind, SequenceSeed
from ..errors import InvariantError, PartitionError, PartitionWarning
from ..mesh import SEQUENCE_AXES
from ..placement import PackedShard, Replicate, Shard, any_sharded, packed_shard, unit_of
from ..rules import Decision, NeedsPacking, NeedsUnit, Unshardable, rule_for, shape_of
from ..rules.attention import RING_AXES
from ..rules.conv import GROUPS_ARGUMENT
from ..rules.pointwise import SIZE_ARGUMENT
from ..rules.propagate import sweep
from ..rules.sequence_dims import SequenceDims, find_sequence_dims
from ..rules.written_attention import attention_operands, written_attention_from_scores
from .annotate_heads import module_path
from . import value_keys
from .context import PassContext
from ..annotations import annotation

R = Replicate()


def ancestors(nodes: list[Node]) -> set[Node]:
    """Every node some node of ``nodes`` reads, directly or not."""
    seen, stack = set(), [n for node in nodes for n in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _candidates(rows: SequenceDims, feeds_attention: set[Node], parts: bool) -> dict[Node, int]:
    """Values offered sharded along their rows, by the graph's dims (``sequence_dims``): every value whose rows are
    an attention's query rows or are computed from such rows (a self-attention's keys and values, the video rows
    audio queries attend over); the parts a joint sequence is joined from only with ``parts``. Rows that are only
    ever keys and values (a text every image row attends to) stay whole: each rank's query rows attend over them
    with no communication, where sharding them would only add exchanges."""
    return {node: dim for node in feeds_attention & rows.attended if (dim := rows.dim(node)) is not None
            and (parts or node in rows.direct)}


def _earliest_ambiguous(rows: SequenceDims, feeds_attention: set[Node], gm: GraphModule) -> dict[Node, int]:
    """When every value that carries rows carries two kinds (a factorised video block: attention within each frame,
    frames folded into the batch, then across frames, positions folded into the batch), sharding starts once, at
    the earliest such value along its outermost row dim: the propagation lays the rest out (one kind of attention
    then runs on its own batch entries, the other exchanges), and an outer dim stays a contiguous shard where a
    view folds it with the inner one."""
    for node in gm.graph.nodes:
        if node in rows.ambiguous and node in feeds_attention and node in rows.attended:
            return {node: min(rows.row_dims[node])}
    return {}


def _convolved_rows(gm: GraphModule, model_tensors: set[Node]) -> dict[Node, int]:
    """Without an attention to read rows from (a VAE with no mid-block attention, an audio VAE): the input of
    every convolution, split along its height (its first spatial dim of the last two; a 1D signal's time), so that
    a convolutional network is split as its attention-bearing kind is. An op that cannot carry the split gathers
    its input; the next convolution's input is split again."""
    seeds = {}
    for node in gm.graph.nodes:
        x = node.args[0] if node.target in GROUPS_ARGUMENT and node.args else None
        shape = shape_of(x) if isinstance(x, Node) and x not in model_tensors else None
        if shape is not None and len(shape) >= 3:
            seeds[x] = max(2, len(shape) - 2)
    return seeds


def _seed_rows(rows: SequenceDims, gm: GraphModule):
    """For each seed, what its rows feed (the attentions they reach and all they read: its ``own`` values), so that a
    value sharded along them is gathered only after the last of those attentions."""
    cache: dict[frozenset, set[Node]] = {}

    def own(seed: Node) -> set[Node]:
        reached = frozenset(rows.attentions.get(seed, ()))
        if reached not in cache:
            cache[reached] = ancestors(list(reached)) | set(reached)
        return cache[reached]
    return own


def _unpacked(decision: Decision, node: Node) -> Decision:
    """On an inner sequence axis no joint sequence is packed from its parts: packed blocks name global sizes, which
    the outer axis has split already (the parts' rows are gathered once their own attentions are done)."""
    outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
    if any(isinstance(p, PackedShard) and len(p.blocks) > 1 for p in outputs):
        raise Unshardable(f"{node.name} joins parts of a sequence, packed on the outer sequence axis only")
    return decision


def _propagate(gm: GraphModule, axis: str, seeds: dict[Node, int], feeds_attention: set[Node], ctx: PassContext,
               refused: dict[Node, Unshardable], rows: SequenceDims, own, gathered: set[Node], gather_done: bool,
               packs: bool, units: dict[Node, int]):
    """One sweep (``partitioner.rules.propagate``): decisions, the seeds that failed before an attention (with why), and
    the values to gather once their own attentions are done.
    A seed's consumers see it sequence-sharded (sliced for free where it is computed whole). An attention that
    refuses its sequence-sharded inputs is recorded in ``refused``; after the last attention a refusal just gathers
    the sequence back. With ``gather_done``, so does a refusal after the last attention *a seed's rows reach*
    (``own``): the value reaching it is gathered right where it is made (``gathered``), its own attention having
    run sharded (H3's text refiner, whose rows are then packed into the main sequence by index)."""
    def seeded(node: Node):  # a plain shard, or in whole groups of rows (strided convolutions ahead)
        dim = seeds[node]
        return packed_shard(dim, (shape_of(node)[dim],), units.get(node, 1), ctx.mesh.size(axis))

    introduced = set()  # the seeds whose sharding starts here (others are sharded already by a seed before them)

    def adjust(node: Node, decision: Decision) -> Decision:
        if node in seeds and not any_sharded(decision.seen):
            introduced.add(node)
            if node.target in SIZE_ARGUMENT:  # a buffer (H3's packed sequence) is made at this rank's size
                decision.output = seeded(node)
            else:
                decision.visible = seeded(node)
        if node in gathered:
            decision.visible = R
        return decision

    def rule_of(node: Node):
        rule = rule_for(node, sequence_axis=axis)
        return rule if packs else lambda node, placements, size: _unpacked(rule(node, placements, size), node)

    swept = sweep(gm, rule_of, ctx.mesh.size(axis), adjust=adjust, is_seed=lambda node, decision: node in seeds)
    failed, to_gather, grow = {}, set(), {}
    for failure in swept.failures:
        problem = failure.problem
        if isinstance(problem, NeedsUnit) and failure.seeds:
            # a strided convolution (or a view regrouping rows): the seeds whose sharding reaches it split their
            # rows in coarser groups, if every one of them is whole groups for each rank; otherwise it is met as any
            # refusal (a joint sequence's text rows are not whole frames: gathered after its attentions)
            have = unit_of(swept.visible.get(problem.node, R))
            targets = introduced & (ancestors([problem.node]) | {problem.node})
            factors = {seed: max(grow.get(seed, 1), math.lcm(have, problem.unit) // have) for seed in targets}
            if targets and all(_whole_groups(seed, seeds[seed], units.get(seed, 1) * factor, ctx.mesh.size(axis))
                               for seed, factor in factors.items()):
                grow.update(factors)
                continue
        if isinstance(problem, NeedsPacking):  # sequence shards are never packed
            problem = Unshardable(f"split into {list(problem.blocks)} rows along the sharded sequence")
        if isinstance(problem, NeedsUnit):  # nor split in units
            problem = Unshardable(f"regrouped in units of {problem.unit} rows along the sharded sequence")
        written = written_attention_from_scores(failure.node)
        if attention_operands(failure.node) is not None or written is not None:  # (an attention refused itself)
            refused[written.output if written is not None else failure.node] = problem
        if failure.node in feeds_attention:
            # a value sharded whole along a joint sequence meets the packed parts: it gives way (sliced to them)
            whole = {s for s in failure.seeds if s in rows.joined}
            culprits = whole if whole and whole != failure.seeds else failure.seeds
            # a value whose rows reach none of the failing op's attentions gives way to the ones that do (H3's text
            # rows, whose own attention is not sharded, meet the packed rows gathered from them)
            reached = rows.attentions.get(failure.node, set())
            other = {s for s in culprits if not rows.attentions.get(s, set()) & reached}
            for seed in (other if other and other != culprits else culprits):
                done = _done_with(failure.node, seed, own(seed), swept) if gather_done else set()
                if done:
                    to_gather |= done
                else:
                    failed.setdefault(seed, f"{failure.node.name}: {problem}")
    parts = {s: r for s, r in failed.items() if s not in rows.joined}
    if parts and len(parts) < len(failed):  # drop failing parts first: a whole joint value may work without them
        failed = parts
    if failed:  # seeds dropped first; what their dropping leaves to gather is found again
        to_gather = set()
    return swept.decisions, failed, to_gather, grow


def _whole_groups(seed: Node, dim: int, unit: int, ranks: int) -> bool:
    """Whether ``seed``'s rows along ``dim`` are whole groups of ``unit`` rows, at least one group for each rank."""
    length = shape_of(seed)[dim]
    return unit * ranks <= length and length % unit == 0


def _done_with(node: Node, seed: Node, own: set[Node], swept) -> set[Node]:
    """The inputs of ``node`` that carry ``seed``'s sharding when ``node`` comes after every attention the seed's
    rows reach (``own``: those attentions and all they read): gathering those inputs serves ``node`` and keeps the
    attentions sharded. Empty when the seed must be dropped instead, or when such an input still feeds one of
    those attentions (gathered, every consumer would see it whole)."""
    if seed not in own or node in own:
        return set()
    inputs = {n for n in node.all_input_nodes if any_sharded(swept.visible.get(n, R))
              and seed in swept.provenance.get(n, ())}
    return set() if inputs & own else inputs


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    first = True
    for axis in [axis for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES]:
        _plan_axis(gm, ctx, axis, joint_parts=first)
        first = first and ctx.mesh.size(axis) <= 1
    return gm


def attention_counts(ctx: PassContext) -> tuple[int, int]:
    """(attentions sequence-sharded over every sequence axis, attentions with query rows to split)."""
    total = sum(not decided.single_query for decided in ctx.sequence_attention.values())
    return total - len(ctx.sequence_whole), total


def warn_whole_attentions(ctx: PassContext, stacklevel: int = 3) -> None:
    """One ``PartitionWarning`` when attentions are left whole over a sequence axis: an exact run that shards
    nothing is no parallelism, and says so unasked (``partition`` and ``plan`` call this)."""
    if ctx.sequence_idle:
        warnings.warn(" and ".join(f"{axis}={ctx.mesh.size(axis)}" for axis in ctx.sequence_idle)
                      + " splits no value of this model: every rank repeats the whole computation (the result is "
                      "exact). No attention's rows or convolution's height reach an op that carries them split; "
                      "drop the axis, or see explain() and docs/vae.md", PartitionWarning, stacklevel=stacklevel)
    if not ctx.sequence_whole:
        return
    axes = " x ".join(f"{a}={ctx.mesh.size(a)}" for a in ctx.mesh.axis_names
                      if a in SEQUENCE_AXES and ctx.mesh.size(a) > 1)
    sharded, total = attention_counts(ctx)
    whole = total - sharded
    what = (f"{axes} shards none of the {total} attentions" if whole == total
            else f"{whole} of {total} attentions are not sequence-sharded over {axes}")
    reasons = list(dict.fromkeys(f"{where}: {why}" for where, why in ctx.sequence_whole.items()))
    warnings.warn(f"{what}: every rank repeats their work (the result is exact). " + "; ".join(reasons[:3])
                  + (" ..." if len(reasons) > 3 else "") + (". Use a smaller degree or drop the axis" if whole == total
                                                             else "") + "; explain() lists each",
                  PartitionWarning, stacklevel=stacklevel)


def _plan_axis(gm: GraphModule, ctx: PassContext, axis: str, joint_parts: bool) -> None:
    """Plan one sequence axis. A joint sequence is packed from its parts only on the first axis that shards:
    packed blocks name global sizes, which an inner axis (Ulysses inside a ring shard) does not split."""
    attentions = [n for n in gm.graph.nodes if attention_operands(n) is not None]
    seeds: dict[Node, int] = {}
    feeds_attention = ancestors(attentions) | set(attentions)
    model_tensors = {node for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    rows = find_sequence_dims(gm, lambda node: rule_for(node, sequence_axis=axis),
                              skip=model_tensors.__contains__)
    # Packed joint sequences and values gathered once their attentions are done are exchanged by this package's own
    # collectives: a plan for XLA's global program (equal tiles, XLA's collectives) shards joint sequences whole.
    given = None if ctx.given_sequence_seeds is None else ctx.given_sequence_seeds.get(axis)
    if given is None and ctx.given_sequence_seeds is not None and ctx.mesh.size(axis) > 1:
        raise PartitionError(f"the plan has no sequence seeds for the axis {axis!r} of the mesh {ctx.mesh.sizes} "
                             f"(it has {sorted(ctx.given_sequence_seeds)}); plan again for this mesh")
    if ctx.mesh.size(axis) > 1:
        seeds = (_given_seeds(gm, given, axis) if given is not None
                 else _candidates(rows, feeds_attention - model_tensors, parts=ctx.mesh.per_rank and joint_parts)
                 or _earliest_ambiguous(rows, feeds_attention - model_tensors, gm)
                 or _convolved_rows(gm, model_tensors))
    refused: dict[Node, Unshardable] = {}
    stopped: dict[str, str] = {}  # this axis's seeds that were given up, and why
    own = _seed_rows(rows, gm)
    gathered: set[Node] = set()
    units: dict[Node, int] = {}  # seeds split in whole groups of rows (an image under strided convolutions)
    while True:
        decisions, failed, to_gather, grow = _propagate(gm, axis, seeds, feeds_attention, ctx, refused, rows, own,
                                                        gathered, gather_done=ctx.mesh.per_rank,
                                                        packs=ctx.mesh.per_rank and joint_parts, units=units)
        for seed, factor in grow.items():  # units only grow, up to a rank's share: the loop ends
            units[seed] = units.get(seed, 1) * factor
            length = shape_of(seed)[seeds[seed]]  # (not ``rows``: that names the sequence dims above)
            if units[seed] * ctx.mesh.size(axis) > length or length % units[seed]:
                failed.setdefault(seed, f"its {length} rows are not whole groups of {units.pop(seed)} rows for each "
                                        f"of {ctx.mesh.size(axis)} ranks (the strides of the convolutions they "
                                        "go through)")
        if grow and not failed:
            continue
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
    if ctx.mesh.size(axis) > 1:
        keys = value_keys.keys_of(gm, seeds)  # in graph order: a plan applied records what deriving it would
        ctx.sequence_seeds[axis] = tuple(SequenceSeed(keys[node], seeds[node]) for node in gm.graph.nodes
                                         if node in seeds)
    _record_attentions(attentions, decisions, refused, ctx, axis, stopped)
    _exchange_at_getitems(decisions)
    for node in gm.graph.nodes:
        annotation(node).placements[axis] = decisions[node].output
        annotation(node).required[axis] = decisions[node].inputs
    ctx.sequence_sharded_at = sorted(n.name for n, _ in seeds.items() if decisions[n].output == R)
    if ctx.mesh.size(axis) > 1 and not any(any_sharded(d.output) for d in decisions.values()):
        ctx.sequence_idle.append(axis)


def _exchange_at_getitems(decisions: dict) -> None:
    """A multi-output op whose consumers see its outputs placed otherwise than it computes them (flex_attention
    under Ulysses: computed by heads, handed on by rows): each getitem takes its element as computed and hands it
    on as seen, so the exchange back sits on the getitem's edges (an edge carries one tensor)."""
    for node, decision in decisions.items():
        if node.op == "call_function" and node.target is operator.getitem:
            made = decisions[node.args[0]]
            if isinstance(made.output, tuple) and made.visible is not None and made.visible != made.output:
                decision.inputs[node.args[0]] = made.output
                decision.output = made.output[node.args[1]]


def _given_seeds(gm: GraphModule, given: tuple[SequenceSeed, ...], axis: str) -> dict[Node, int]:
    """A plan's seeds, found by their keys (``value_keys``); a key this graph has no value for, or a dim the value
    does not have, means the plan is for another model or other input shapes."""
    nodes = value_keys.find(gm, [seed.key for seed in given], f"the plan's sequence seeds over {axis!r}")
    for seed in given:
        value = nodes[seed.key].meta.get("val")
        rank = value.dim() if isinstance(value, torch.Tensor) else None
        if rank is None or not -rank <= seed.dim < rank:
            shape = list(value.shape) if rank is not None else f"not a tensor ({type(value).__name__})"
            raise PartitionError(f"the plan's sequence seed over {axis!r} at {seed.key}: dim {seed.dim}, which the "
                                 f"value (shape {shape}) does not have; plan again for this model and these example "
                                 "input shapes")
    return {nodes[seed.key]: seed.dim for seed in given}


def _record_attentions(attentions: list[Node], decisions: dict, refused: dict[Node, Unshardable], ctx: PassContext,
                       axis: str, stopped: dict[str, str]) -> None:
    """Which attentions are sequence-sharded over ``axis``, and why the others are not (``Partitioned.explain``;
    with two sequence axes each line names its axis). An attention too short or with too few heads for the degree
    is left whole; a ulysses degree that shards no attention warns, a ring that shards none is refused."""
    if ctx.mesh.size(axis) <= 1:
        return
    found: dict[str, AttentionSequence] = {}
    for node in attentions:
        info = annotation(node).heads
        where = info.module if info is not None else module_path(node) or node.name
        decision = decisions[node]
        q, k, _ = attention_operands(node)
        # (flex_attention computes a tuple: its output, then its logsumexp)
        output = decision.output[0] if isinstance(decision.output, tuple) else decision.output
        rows = len(shape_of(q) or (1, 1, 1, 1)) - 2  # (a written attention may fold batch and heads: 3-D)
        if (shape_of(q) or (1, 1))[-2] == 1:  # one query (a pooling): no rows to split, a negligible cost
            found[where] = AttentionSequence(SequenceKind.SINGLE_QUERY)
        elif output == Shard(rows - 1) and decision.visible not in (None, output):  # exchanged to a head shard
            found[where] = AttentionSequence(SequenceKind.ULYSSES)
        elif getattr(output, "dim", None) == rows and any_sharded(decision.inputs.get(k, R)):
            found[where] = AttentionSequence(SequenceKind.RING)
        elif getattr(output, "dim", None) == rows:  # this rank's query rows over whole keys, values
            found[where] = AttentionSequence(SequenceKind.QUERY_ROWS)
        elif getattr(output, "dim", rows) < rows:  # its batch entries (or heads) carry the split, as they come
            found[where] = AttentionSequence(SequenceKind.BATCH)
        elif node in refused:
            found[where] = AttentionSequence(SequenceKind.WHOLE, refused[node].detail, refused[node].where)
        else:
            why = sorted(stopped[n.name] for n in ancestors([node]) if n.name in stopped)
            found[where] = AttentionSequence(SequenceKind.WHOLE, "its query, key and value reach it whole" + (
                f" (sharding stopped at {why[0]})" if why else " (no input of it has the sequence length)"))
    for where, decided in found.items():
        if decided.kind is SequenceKind.WHOLE:
            # (the warning names the attention once: a rule's refusal about it is given without its name)
            ctx.sequence_whole.setdefault(where, f"{axis}: {decided.reason if decided.about == where else decided.why}")
        earlier = ctx.sequence_attention[where].by_axis if where in ctx.sequence_attention else ()
        ctx.sequence_attention[where] = AttentionSequencing((*earlier, (axis, decided)))
    if attentions and axis in RING_AXES and not any(decided.sharded for decided in found.values()):
        reasons = sorted({decided.why or str(decided) for decided in found.values()})
        raise PartitionError(f"a ring of {ctx.mesh.size(axis)} shards no attention of this model: "
                             + "; ".join(reasons[:4]) + "; use a smaller ring degree (at most the shortest "
                             "sequence) or drop the ring axis")


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every node has a placement for each sequence axis of the mesh."""
    for axis in [axis for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES]:
        for node in gm.graph.nodes:
            if axis not in annotation(node).placements:
                raise InvariantError(f"{node.name} has no {axis} placement")
