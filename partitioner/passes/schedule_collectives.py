"""schedule_collectives: issue each collective as early as its inputs allow and wait on it as late as there is
independent compute to run meanwhile.

Requires: localize has run (this rank's shapes, which the compute estimates read).
Guarantees: the graph computes the same values; collectives are issued in the same order as before (every rank
runs the same collectives in the same order, whatever this rank's own estimates); no node moves out of its
repeated block's run of nodes (Inductor's regions stay whole, one compilation per distinct block).

The rule is a list schedule over each run of nodes, in the original order except that
- a collective whose turn has come (its inputs computed, every earlier collective issued) goes first;
- among the other nodes ready, those the next collective reads (directly or not) go first, where its estimated time
  is not zero and within the hoisting limits below: Ulysses' query exchange is issued once the queries are computed
  and runs while the keys and values are (the original order computes all three projections first);
- a wait (``wait_tensor``) gives way to any other node that is ready while the collective's estimated time on the
  device profile (``partitioner.planning.cost``; the share of it compute can hide, the profile's ``overlap``) is not yet
  covered by the compute run since it was issued. Giving way past that would only keep more values alive, so it
  stops there; on a profile where nothing can be hidden nothing moves.
Overlap is never bought with memory: a node is hoisted over a wait only while the run's values stay within the
bytes they hold at once in the original order (``peak_bytes``: a value computed early lives longer); a run whose
whole schedule still holds more (what is hoisted stays alive while later nodes run) is scheduled again with a
lower bound for hoisting (``HOIST_LIMITS``), and keeps its original order if none holds.
A run whose code and every figure the schedule reads (estimates, bytes, which values outlive it) equal a run's
already scheduled takes that run's order (50 blocks of H3 are scheduled once).
Collectives issued by one node and waited on by another (all_reduce, all_gather, reduce_scatter, all_to_all) are
overlapped; synchronous ones (ring attention, sharded norms, halo convolution) keep their places in the collective
order. A collective holds what it sends until its wait (``report.held_bytes``), so exchanges in flight together
count their send buffers against the memory bound.
"""

from __future__ import annotations

import heapq
from collections import Counter

from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..planning.cost import collective_s, load_profile, node_compute_s
from ..planning.report import aliases, collective_calls, held_bytes
from ..runtime import collectives
from .context import PassContext
from .regions import code_of, runs_of_blocks
from ..annotations import annotation

# Shares of the run's original peak bytes hoisting may hold, tried in turn until the whole schedule stays within it
HOIST_LIMITS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)


def issues_collective(node: Node) -> bool:
    return annotation(node).collective is not None or (
        "_c10d_functional" in str(node.target) and node.target not in collectives.WAITS)


def _is_wait(node: Node) -> bool:
    return node.target in collectives.WAITS


def _base(node: Node) -> Node:
    """What a view (a chain of views) views."""
    while aliases(node):
        node = node.args[0]
    return node


class _Live:
    """The bytes a run's values hold as its nodes are scheduled: each from the node that makes it (or the run's
    start) to its last use (to the run's end when a later node reads it); a view keeps what it views alive and
    holds nothing itself."""

    def __init__(self, run: list[Node]):
        inside = set(run)
        self.owner: dict[Node, Node | None] = {}
        # values made before the run and read in it (through views too) live until their last use here, or on if
        # read later; parameters and inputs always live and are left out
        earlier = {_base(n) for node in run for n in node.all_input_nodes if n not in inside}
        earlier = {n for n in earlier if n not in inside and n.op != "placeholder"}
        for node in earlier:
            self.owner[node] = node
        for node in run:
            if node.op == "placeholder":
                continue
            for n in node.all_input_nodes:
                if n not in inside and n not in self.owner:  # an earlier view: it reads what it views
                    self.owner[n] = self.owner.get(_base(n))
            self.owner[node] = self.owner.get(_base(node)) if aliases(node) else node
        self.uses: Counter = Counter()  # owner -> uses not yet scheduled (a use after the run never is)
        for node in {*earlier, *run, *(n for node in run for n in node.all_input_nodes if n in self.owner)}:
            if self.owner.get(node) is not None:
                for user in node.users:
                    self.uses[self.owner[node]] += 1 if user in inside else len(run) + 1
        self.bytes = sum(held_bytes(node) for node in earlier)
        self.values: set[Node] = set(earlier)  # the values held now (owners)

    def _change(self, node: Node) -> tuple[int, int]:
        """(bytes ``node`` adds, bytes freed once it has run)."""
        added = held_bytes(node) if self.owner[node] is node else 0
        reads = Counter(self.owner[n] for n in node.all_input_nodes if self.owner.get(n) is not None)
        freed = sum(held_bytes(owner) for owner, k in reads.items() if self.uses[owner] == k)
        return added, freed + (added if self.uses[node] == 0 else 0)

    def peak_if_next(self, node: Node) -> int:
        return self.bytes + self._change(node)[0]

    def schedule(self, node: Node) -> int:
        """Schedule ``node``; returns the bytes held while it runs."""
        added, freed = self._change(node)
        for n in node.all_input_nodes:
            if self.owner.get(n) is not None:
                self.uses[self.owner[n]] -= 1
                if self.uses[self.owner[n]] == 0:
                    self.values.discard(self.owner[n])
        if added and self.uses[node]:
            self.values.add(node)
        held = self.bytes + added
        self.bytes = held - freed
        return held


def peak_bytes(order: list[Node]) -> int:
    """The most bytes a run's own values hold at once in this order (``_Live``)."""
    return _peak(order)[0]


def _peak(order: list[Node]) -> tuple[int, set[Node]]:
    """The most bytes a run's own values hold at once in this order, and the values held then."""
    live, peak, held = _Live(order), -1, set()
    for node in order:
        before = set(live.values)
        now = live.schedule(node)
        if now > peak:
            peak, held = now, before | {node}
    return max(peak, 0), held


def _ancestors_in(node: Node, position: dict, done: set[Node]) -> set[Node]:
    """The nodes of the run that ``node`` reads, directly or not, that are not ``done``."""
    seen, stack = set(), [node]
    while stack:
        for n in stack.pop().all_input_nodes:
            if n in position and n not in seen and n not in done:
                seen.add(n)
                stack.append(n)
    return seen


def _order(run: list[Node], compute_s, comm_s, limit: float, pinned: frozenset = frozenset()) -> list[Node]:
    """The schedule of one run of nodes (see the module docstring); a node is hoisted over a wait only while the
    run's values hold at most ``limit`` bytes, and never a ``pinned`` one."""
    position = {node: i for i, node in enumerate(run)}
    missing = {node: sum(1 for n in node.all_input_nodes if n in position) for node in run}
    collectives = [node for node in run if issues_collective(node)]
    ready = [(position[node], node) for node in run if missing[node] == 0]
    heapq.heapify(ready)
    uncovered: dict[Node, float] = {}  # issued collective -> its estimated time not yet covered by compute
    order, done, turn, live = [], set(), 0, _Live(run)

    def eligible(node: Node) -> bool:
        return not issues_collective(node) or collectives[turn] is node

    def feeding(turn: int) -> set[Node]:
        """What the collective whose turn it is reads and is not run yet (none where it has nothing to hide)."""
        upcoming = collectives[turn] if turn < len(collectives) else None
        return _ancestors_in(upcoming, position, done) if upcoming is not None and comm_s(upcoming) else set()

    feeds = feeding(turn)

    while ready:
        candidates = [node for _, node in sorted(ready) if eligible(node)]
        if not candidates:
            raise InvariantError(f"schedule_collectives: no node of {run[0].name}..{run[-1].name} can run next")
        chosen = next((node for node in candidates if issues_collective(node)), None)
        if chosen is None:
            # compute the next collective reads first, so it is issued (and overlaps what follows) sooner; a node
            # moved ahead of the first candidate obeys the hoisting limits below
            chosen = next((node for node in candidates if node in feeds and (node is candidates[0] or (
                node not in pinned and live.peak_if_next(node) <= limit))), candidates[0])
            if _is_wait(chosen) and uncovered.get(chosen.args[0], 0.0) > 0:
                chosen = next((node for node in candidates if not _is_wait(node) and node not in pinned
                               and live.peak_if_next(node) <= limit), chosen)
        ready.remove((position[chosen], chosen))
        heapq.heapify(ready)
        order.append(chosen)
        done.add(chosen)
        live.schedule(chosen)
        spent = compute_s(chosen)  # (a ring attention both communicates and computes)
        for issued in uncovered:
            uncovered[issued] = max(0.0, uncovered[issued] - spent)
        if issues_collective(chosen):
            turn += 1
            feeds = feeding(turn)
            if any(_is_wait(user) for user in chosen.users):
                uncovered[chosen] = comm_s(chosen)
        if _is_wait(chosen):
            uncovered.pop(chosen.args[0], None)
        for user in chosen.users:
            if user in missing:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, (position[user], user))
    if len(order) != len(run):
        raise InvariantError(f"schedule_collectives: scheduled {len(order)} of {len(run)} nodes")
    return order


def _within_memory(run: list[Node], compute_s, comm_s) -> list[Node] | None:
    """A schedule of ``run`` whose values never hold more bytes at once than in the original order, or None.
    A node hoisted over a wait that is still held at the schedule's peak (computed early, it lives across a
    larger value) is pinned to its place and the run scheduled again; then the hoisting limit is lowered."""
    limit, original = peak_bytes(run), {node: i for i, node in enumerate(run)}
    for share in HOIST_LIMITS:
        pinned: set[Node] = set()
        while True:
            order = _order(run, compute_s, comm_s, share * limit, frozenset(pinned))
            peak, held = _peak(order)
            if peak <= limit:
                return order
            position = {node: i for i, node in enumerate(order)}
            early = {node for node in held if node in original and position[node] < original[node]} - pinned
            if not early:
                break
            pinned |= early
    return None


def schedule_key(run: list[Node], compute_s, comm_s) -> tuple:
    """Everything ``_within_memory`` reads of a run: its code (values from outside numbered in order), each node's
    estimates and bytes, which of its values are read after it, and what the values it reads from outside view
    and hold. Two runs with one key get one schedule."""
    code, external = code_of(run)
    inside = set(run)
    nodes = tuple((issues_collective(node), compute_s(node), comm_s(node) if issues_collective(node) else 0.0,
                   held_bytes(node), aliases(node), any(user not in inside for user in node.users)) for node in run)

    def read_after(node: Node) -> int:
        return sum(1 for user in node.users if user not in inside)

    bases = {base: i for i, base in enumerate(dict.fromkeys(_base(node) for node in external))}
    outside = tuple((aliases(node), read_after(node), bases[base], held_bytes(base), base.op, read_after(base))
                    for node, base in ((node, _base(node)) for node in external))
    return code, nodes, outside


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    ctx.collective_order = [node.name for node in gm.graph.nodes if issues_collective(node)]
    if not ctx.overlap.schedule or ctx.mesh.world_size == 1:
        return gm
    profile = load_profile(ctx.overlap.profile_for(ctx.mesh.device_type))
    groups = {axis: ctx.mesh.groups(axis) for axis in ctx.mesh.axis_names}

    def comm_s(node: Node) -> float:
        kind, axis = annotation(node).collective or ("all_reduce", None)
        if axis is None:
            return 0.0
        size, calls = collective_calls(node)
        mine = next(g for g in groups[axis] if ctx.mesh.rank in g)
        return profile.overlap * calls * collective_s(kind, size, mine, groups[axis], profile)

    def compute_s(node: Node) -> float:
        return node_compute_s(node, profile)[0]

    first = next(node for node in gm.graph.nodes if node.op != "placeholder")
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:  # (a local slice may sit between them)
        first.prepend(node)
    scheduled: dict[tuple, list[int] | None] = {}  # a run's schedule_key -> its order, as positions in the run
    for run_ in runs_of_blocks(gm.graph.nodes):
        key = schedule_key(run_, compute_s, comm_s)
        if key not in scheduled:
            order = _within_memory(run_, compute_s, comm_s)
            position = {node: i for i, node in enumerate(run_)}
            scheduled[key] = None if order is None else [position[node] for node in order]
        if scheduled[key] is None:
            continue
        order = [run_[i] for i in scheduled[key]]
        anchor = run_[0].prev
        for node in order:
            anchor.append(node)
            anchor = node
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: the collectives are issued in the order they had before the pass."""
    now = [node.name for node in gm.graph.nodes if issues_collective(node)]
    if now != ctx.collective_order:
        raise InvariantError("schedule_collectives changed the order in which collectives are issued, which every "
                             "rank must share")
