"""Ranks that agree, or fail together in bounded time.

A rank's program is one half of a conversation: if one rank skips a collective (it rejected its inputs, it hit an
error, it built another plan), its peers block, and once they are released they pair later messages with the
wrong ones. So:

- every collective of a partition runs on process groups created for it with a bounded ``timeout``
  (``rank_groups.bounded_groups``): a peer that never arrives becomes a ``CollectiveTimeout`` instead of a 30-minute
  hang;
- at build time the ranks compare a fingerprint of their plans (``agree_on_plan``): a rank that built another plan,
  or failed to build one, is named on every rank before any program runs;
- at call time every input check runs before the first collective, then one small all_reduce tells every rank
  which ranks rejected the call and whether all ranks were called alike (``CallGuard.agree``): a rejection on any
  rank raises on every rank, and the partition stays usable. The all_reduce is issued as soon as the checks are
  done and waited for just before the program's first collective (``CallGuard.start``, ``settle_pending``): the
  compute ahead of that collective overlaps it, and no collective of the program runs on a call not agreed on;
- a failure after that point (inside the program) marks the partition unusable (``CallGuard.running``): the next
  call says to rebuild it rather than run on a message stream that may be out of step;
- each call's agreement also carries a digest of every input tensor's values (``values_digest``: a fixed strided
  sample of each, hashed on the host or summed in float64 on an accelerator, or every byte hashed): ranks called
  with other values (latents seeded differently) raise ``InputError`` on every rank naming the inputs and the ranks;
  the plan check likewise compares a sampled digest of the model's weights (``weights_digest``);
- process groups are reused by a decision every rank takes alike (``bounded_groups``): the ranks meet in the
  default group's store (keys, not messages: nothing stale can pair with them) and create fresh groups when any
  rank saw its groups time out; the groups' generation is part of the plan the ranks compare.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import (CheckpointError, CollectiveTimeout, ConcurrentCall, FailedOnAnotherRank, InputError,
                      PartitionUnusable, RankDisagreement)
from .collectives import WAITS
from .rank_groups import RankGroups, first_line, forget
from .fingerprints import _number, check_fingerprint, fingerprints, values_digest
from ..annotations import annotation

def _exchange(groups: RankGroups, value, what: str) -> list:
    gathered = [None] * dist.get_world_size(groups.world)
    try:
        dist.all_gather_object(gathered, value, group=groups.world)
    except RuntimeError as error:
        forget(groups)
        raise CollectiveTimeout(f"ranks did not all reach {what} within {groups.timeout:g} s: a rank failed before "
                                f"it, hangs, or was not started ({first_line(error)})") from error
    return gathered


def agree_on_staging(guard: "CallGuard", failure: BaseException | None, what: str) -> None:
    """All or nothing across ranks: each rank staged its part of ``what`` (or failed to); one exchange, then every
    rank commits, or every rank raises a ``CheckpointError`` naming each failed rank and its reason."""
    groups = guard.groups
    if groups is None:
        if failure is not None:
            raise failure
        return
    mine = None if failure is None else f"{type(failure).__name__}: {first_line(failure)}"
    try:
        every = _exchange(groups, mine, what)
    except CollectiveTimeout as error:
        guard.broken = f"{what} timed out"
        raise CollectiveTimeout(f"{error}; no rank committed the new weights, and the partition must be made again "
                                "on every rank") from error
    failed = {rank: message for rank, message in enumerate(every) if message is not None}
    if failed:
        summary = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}, so no rank loaded it (every rank keeps "
                              f"its previous weights): {summary}") from failure


def plan_lines(planned: torch.fx.GraphModule, header: list[str]) -> list[str]:
    """The plan as text, one decision a line: the header (mesh, options), then each node with its placements."""
    lines = list(header)
    for node in planned.graph.nodes:
        placements = (annotation(node).placements or {})
        lines.append(f"{node.name} = {node.format_node()} | {placements}")
    return lines


def agree_on_plan(groups: RankGroups | None, lines: list[str] | None, failure: BaseException | None) -> None:
    """Compare every rank's plan (``lines``) or build failure; raise on every rank if they differ."""
    if groups is None:
        if failure is not None:
            raise failure
        return
    mine = ("failed", f"{type(failure).__name__}: {first_line(failure)}") if failure is not None else \
        ("plan", hashlib.sha256("\n".join(lines).encode()).hexdigest())
    every = _exchange(groups, mine, "the plan check of partition()")
    failed = {rank: message for rank, (kind, message) in enumerate(every) if kind == "failed"}
    if failed:
        if failure is not None:
            raise failure
        raise FailedOnAnotherRank(f"rank(s) {sorted(failed)} failed to partition, so no rank runs: "
                               + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
    if len({digest for _, digest in every}) == 1:
        return
    plans = _exchange(groups, lines, "the plan comparison of partition()")
    differing = [rank for rank, plan in enumerate(plans) if plan != plans[0]]
    rank = differing[0]
    index = next((i for i, (a, b) in enumerate(zip(plans[0], plans[rank])) if a != b),
                 min(len(plans[0]), len(plans[rank])))
    show = lambda plan: plan[index] if index < len(plan) else "<end of plan>"  # noqa: E731
    first, other = _around_difference(show(plans[0]), show(plans[rank]))
    raise RankDisagreement(
        f"ranks built different plans: rank(s) {differing} differ from rank 0, first at decision {index}:\n"
        f"  rank 0:    {first}\n  rank {rank}: {other}\n"
        "every rank must call partition with the same model, example input shapes and options")


def _around_difference(a: str, b: str, width: int = 400) -> tuple[str, str]:
    """Two lines cut to ``width`` characters around the first character where they differ (never before it)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, at - width // 4) if at >= width * 3 // 4 else 0
    cut = lambda line: ("..." if start else "") + line[start:start + width] + \
        ("..." if len(line) > start + width else "")  # noqa: E731
    return cut(a), cut(b)


@dataclass(frozen=True)
class PartitionIdentity:
    """Which partition a call is of: two partitions of one mesh share its groups (two experts), and a call of one on
    a rank while its peer calls the other must be refused."""
    model: str
    number: int  # its place among the partitions agreed on these groups (0 without groups)
    plan: str  # a digest of the plan the ranks agreed on

    def __str__(self) -> str:
        return f"{self.model}{f' #{self.number}' if self.number else ''} (plan {self.plan})"


class CallGuard:
    """Wraps every call of a lowered program: ``agree`` before the first collective, ``running`` around it.
    ``fingerprint``: how each call's input values are compared between ranks ("sample", "full" or "off")."""

    def __init__(self, groups: RankGroups | None, device: torch.device, fingerprint: str = "sample",
                 identity: PartitionIdentity | None = None):
        self.groups = groups
        self.device = device if groups is not None and dist.get_backend(groups.world) != "gloo" else \
            torch.device("cpu")
        self.broken: str | None = None
        self.fingerprint = check_fingerprint(fingerprint)
        self.identity = identity  # which partition: its model and plan (two may share one mesh's groups)

    @contextlib.contextmanager
    def exclusive(self):
        """One call at a time on this mesh's groups, from one thread: a second thread's call while one runs is
        refused at once (a lock that made it wait could not make the ranks take their threads in the same order,
        and their collectives would pair crosswise)."""
        if self.groups is None:
            yield
            return
        if not self.groups.calls.acquire(blocking=False):
            who = self.identity.model if self.identity else "this partition"
            raise ConcurrentCall(f"{who}: another thread is running a call on this mesh's process groups; call each "
                                 "mesh's partitions from one thread per rank (one call at a time)")
        try:
            yield
        finally:
            self.groups.calls.release()

    @property
    def group(self):
        return self.groups.world if self.groups is not None else None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise PartitionUnusable(f"an earlier call failed after its first collective ({self.broken}); the ranks' "
                                    "message streams may be out of step: partition the model again on every rank")
        if self.groups is not None and (not dist.is_initialized() or not self.groups.alive):
            raise PartitionUnusable("this partition's process groups are gone: the default process group was "
                                    "destroyed (destroy_process_group) after it was made, or the groups were replaced "
                                    "after a collective on them failed; init_process_group if needed and partition "
                                    "the model again on every rank")

    def agree(self, problem: InputError | None, signature: int, describe=None,
              values: list[tuple[str, torch.Tensor]] | None = None, exact=frozenset(), marker: str = "") -> None:
        """One all_reduce: which ranks rejected this call, whether every rank's call looks alike (``signature``;
        ``describe()``: the call's shapes in words, exchanged only when the signatures differ), and whether every
        rank's input values are alike (``values``: (name, tensor) fingerprinted as ``self.fingerprint`` says, those
        named in ``exact`` hashed whole; ``marker``: which program the call chose, compared with them)."""
        pending = self.start(problem, signature, describe, values, exact, marker)
        if pending is not None:
            pending.settle()

    def start(self, problem: InputError | None, signature: int, describe=None,
              values: list[tuple[str, torch.Tensor]] | None = None, exact=frozenset(),
              marker: str = "") -> "PendingAgreement | None":
        """``agree``'s all_reduce issued and not waited for: the program's first compute overlaps it, and the
        program settles it before its first collective (``settle_pending``). Without groups, or where this rank
        rejected the call, it is settled here: None is returned without groups, the refusal raised otherwise."""
        self.check_usable()
        if self.groups is None:
            if problem is not None:
                raise problem
            return None
        values = values or []
        digest = values_digest(values, self.fingerprint, exact) if problem is None else ""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        status = torch.zeros(world, 4, dtype=torch.int64, device=self.device)
        status[rank, 0] = int(problem is not None)
        status[rank, 1] = _number(f"{signature} {self.fingerprint}") if problem is None else 0
        status[rank, 2] = _number(f"{marker} {digest}") if problem is None else 0
        status[rank, 3] = _number(str(self.identity))
        try:
            work = dist.all_reduce(status, group=self.group, async_op=True)
        except RuntimeError as error:
            self._timed_out(error)
        pending = PendingAgreement(self, work, status, problem, describe, values, exact, marker)
        if problem is not None:  # this rank runs nothing: it learns the other ranks' reasons now and raises
            pending.settle()
        return pending

    def _timed_out(self, error: RuntimeError):
        self.broken = f"the input agreement timed out: {first_line(error)}"
        forget(self.groups)
        raise CollectiveTimeout(f"ranks did not all call the partition within {self.groups.timeout:g} s "
                                f"({first_line(error)}); every rank must make every call") from error

    @contextlib.contextmanager
    def running(self, programs: list[torch.fx.GraphModule], pending: PendingAgreement | None = None):
        """Run the program (settling its ``pending`` agreement, at the latest when it returns); on any failure mark
        the partition unusable and name the collective that timed out."""
        self.check_usable()
        try:
            with pending.armed() if pending is not None else contextlib.nullcontext():
                yield
            if pending is not None:  # a program with no collective: its output stands only once the ranks agreed
                pending.settle()
        except BaseException as error:
            if self.groups is None:  # one process drives every device (or plans only): nothing is out of step
                raise
            if pending is not None and error is pending.refusal:  # refused before the first collective: usable
                raise
            if pending is not None:  # (an interrupt stays one, below)
                pending.settle_before_raising(error)
            if isinstance(error, KeyboardInterrupt):  # stays what it is on the interrupted rank; peers time out
                self.broken = "a call was interrupted (KeyboardInterrupt) on this rank"
                forget(self.groups)
                raise
            where = failing_node(error, programs)
            self.broken = f"{type(error).__name__} at {where or 'an unknown node'}: {first_line(error)}"
            forget(self.groups)
            if where is not None and _is_collective_failure(error, where):
                raise CollectiveTimeout(f"{describe_collective(where)} did not complete within "
                                        f"{self.groups.timeout:g} s, or failed: a peer rank "
                                        f"failed or hangs ({first_line(error)}); partition the model again on every "
                                        "rank") from error
            raise


class PendingAgreement:
    """A call's agreement in flight (``CallGuard.start``): ``settle`` waits for it and raises ``InputError`` on every
    rank when any rank rejected the call or the ranks' calls differ, as ``CallGuard.agree`` does. Settled once:
    before the program's first collective (``armed`` + ``settle_pending``, which a lowered program calls) or, for
    programs that do not, before the program runs."""

    def __init__(self, guard: CallGuard, work, status: torch.Tensor, problem, describe, values, exact, marker: str):
        self.guard, self.work, self.status = guard, work, status
        self.problem, self.describe, self.values, self.exact, self.marker = problem, describe, values, exact, marker
        self.refusal: BaseException | None = None  # what settling raised: no collective of the program ran
        self.settled = False

    def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        try:
            self._settle()
        except Exception as error:  # (an interrupt while waiting is not the ranks' verdict)
            self.refusal = error
            raise

    def settle_before_raising(self, error: BaseException) -> None:
        """This rank failed (``error``) before settling: the ranks' verdict on the call comes first (its peers
        settle it too, and may need this rank's reasons). Raises the refusal, ``error`` chained, where they refused
        the call; an interrupt is left to be raised as it is."""
        if self.settled:
            return
        try:
            self.settle()
        except InputError as refusal:
            if isinstance(error, Exception):
                raise refusal from error

    @contextlib.contextmanager
    def armed(self):
        """While the program runs on this thread, ``settle_pending`` settles this agreement."""
        outer, _ARMED.pending = getattr(_ARMED, "pending", None), self
        try:
            yield
        finally:
            _ARMED.pending = outer

    def _settle(self) -> None:
        guard, problem = self.guard, self.problem
        try:
            self.work.wait()
        except RuntimeError as error:
            guard._timed_out(error)
        status = self.status.cpu()
        if len(set(status[:, 3].tolist())) > 1:  # two partitions of one mesh, called crosswise: nothing else matters
            called = _exchange(guard.groups, str(guard.identity), "the input agreement")
            raise InputError("the ranks called different partitions of this mesh at once ("
                             + "; ".join(f"rank {r}: {who}" for r, who in enumerate(called))
                             + "); every rank must call the mesh's partitions in the same order")
        rejected = status[:, 0].nonzero().flatten().tolist()
        if rejected:
            reasons = _exchange(guard.groups, str(problem) if problem is not None else None, "the input agreement")
            summary = "; ".join(f"rank {r}: {reasons[r]}" for r in rejected)
            if problem is not None:
                raise InputError(f"rank(s) {rejected} rejected this call, so no rank runs it: {summary}") from problem
            raise InputError(f"rank(s) {rejected} rejected this call, so no rank runs it: {summary}")
        signatures = status[:, 1].tolist()
        if len(set(signatures)) > 1:
            odd = [r for r, s in enumerate(signatures) if s != signatures[0]]
            calls = _exchange(guard.groups, (self.describe() if self.describe is not None else "", guard.fingerprint),
                              "the input agreement")
            modes = {r: mode for r, (_, mode) in enumerate(calls)}
            if len(set(modes.values())) > 1:
                raise InputError("ranks compare input values differently (input_fingerprint: "
                                 + ", ".join(f"rank {r}: {m!r}" for r, m in modes.items())
                                 + "); set the same input_fingerprint on every rank")
            differ = "; ".join(f"rank {r}: {calls[r][0]}" for r in [0, *odd] if calls[r][0])
            raise InputError(f"rank(s) {odd} were called with other input shapes, dtypes or options than rank 0"
                             + (f" ({differ})" if differ else "")
                             + "; every rank must make the same call (the same shapes, the same values)")
        digests = status[:, 2].tolist()
        if len(set(digests)) > 1:
            mine = fingerprints(self.values, guard.fingerprint, self.exact) if problem is None else []
            every = _exchange(guard.groups, (self.marker, mine), "the input agreement")
            raise InputError(_values_differ(every))


_ARMED = threading.local()  # the agreement the program running on this thread settles before its first collective


def settle_pending() -> None:
    """Settle the armed agreement, if any (a lowered program calls this before its first collective)."""
    pending = getattr(_ARMED, "pending", None)
    if pending is not None:
        pending.settle()


def settle_point(nodes) -> torch.fx.Node | None:
    """Where a program settles its call's agreement: before its first node that communicates, or before the first
    node of its second repeated block, whichever comes first. The compute that overlaps the agreement is so bounded
    by the glue and one block: a peer that rejected the call waits that long for this rank to learn it."""
    from ..passes.regions import repeated_block

    first_block = None
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        if annotation(node).collective is not None:
            return node
        block = repeated_block(node)
        if block is not None and first_block is None:
            first_block = block
        elif block is not None and block != first_block:
            return node
    return None


def settling_first(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that calls ``settle_pending`` at its ``settle_point``, so the call's agreement overlaps the
    compute ahead of it; ``gm`` itself when it has no such point (it settles when it returns)."""
    point = settle_point(gm.graph.nodes)
    if point is None:
        return gm
    from ..frontend.trace import lazy_code

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # (each node's meta copied shallowly: the annotations shared)
    copy = lazy_code(gm, graph)
    with copy.graph.inserting_before(list(copy.graph.nodes)[list(gm.graph.nodes).index(point)]):
        copy.graph.call_function(settle_pending, ())
    copy.recompile()
    copy.settles_agreement = True
    return copy


def _values_differ(every: list[tuple[str, list[tuple[str, str]]]]) -> str:
    """The message for ranks whose calls have the same shapes but other values: which inputs differ, on which ranks,
    with their fingerprints."""
    reference = dict(every[0][1])
    differing: dict[str, list[int]] = {}
    for rank, (_, prints) in enumerate(every):
        for name, value in prints:
            if reference.get(name) != value:
                differing.setdefault(name, []).append(rank)
    if not differing:
        markers = "; ".join(f"rank {r}: {m or 'the traced program'}" for r, (m, _) in enumerate(every))
        return (f"the ranks chose different programs for this call ({markers}); every rank must make the same "
                "calls in the same order")
    lines = []
    for name, ranks in differing.items():
        shown = ", ".join(f"rank {r}: {dict(every[r][1]).get(name)}" for r in [0, *ranks])
        lines.append(f"{name} on rank(s) {ranks} ({shown})")
    odd = sorted({r for ranks in differing.values() for r in ranks})
    return (f"rank(s) {odd} were called with other input values than rank 0, so no rank runs this call: "
            + "; ".join(lines) + ". Every rank must be called with the same inputs (seed every rank's random "
            "latents alike); input_fingerprint='off' turns this check off")


def failing_node(error: BaseException, programs: list[torch.fx.GraphModule]) -> torch.fx.Node | None:
    """The innermost graph node the traceback of ``error`` passes through, in any of ``programs`` (and their
    submodules: Inductor's regions)."""
    files = {}
    for program in programs:
        for module in program.modules() if isinstance(program, torch.nn.Module) else ():
            if isinstance(module, torch.fx.GraphModule):
                files[module.forward.__code__.co_filename] = module
    found, tb = None, error.__traceback__
    while tb is not None:
        module = files.get(tb.tb_frame.f_code.co_filename)
        if module is not None:  # the generated line assigns the node's value: ``    name = torch.ops...``
            lines = module.code.splitlines()
            match = _ASSIGNMENT.match(lines[tb.tb_lineno - 1]) if 0 < tb.tb_lineno <= len(lines) else None
            nodes = {node.name: node for node in module.graph.nodes}
            if match and match[1] in nodes:
                found = nodes[match[1]]
        tb = tb.tb_next
    return found


_ASSIGNMENT = re.compile(r"^\s+(\w+)(?:\s*:[^=]*)?\s*=\s")


def _is_collective_failure(error: BaseException, node: torch.fx.Node) -> bool:
    waits_for_one = (node.target in WAITS and isinstance(node.args[0], torch.fx.Node)
                     and annotation(node.args[0]).collective is not None)
    return (annotation(node).collective is not None or waits_for_one
            or isinstance(error, getattr(dist, "DistBackendError", ()))
            or "timed out" in str(error).lower() or "timeout" in str(error).lower())


def describe_collective(node: torch.fx.Node) -> str:
    if annotation(node).collective is not None:
        kind, axis = annotation(node).collective
        return f"the {kind} {node.name} over mesh dim {axis!r}"
    if node.target in WAITS:
        source = node.args[0]
        if annotation(source).collective is not None:
            return describe_collective(source)
    return f"a collective inside {node.name}"


__all__ = ["CallGuard", "PartitionIdentity", "PendingAgreement", "agree_on_plan", "agree_on_staging", "plan_lines",
           "settle_pending", "settle_point", "settling_first"]
