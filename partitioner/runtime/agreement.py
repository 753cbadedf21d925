"""Ranks that agree, or fail together in bounded time.

A rank's program is one half of a conversation: if one rank skips a collective (it rejected its inputs, it hit an
error, it built another plan), its peers block, and once they are released they pair later messages with the
wrong ones. So:

- every collective of a partition runs on process groups created for it with a bounded ``timeout``
  (``bounded_groups``): a peer that never arrives becomes a ``CollectiveTimeout`` instead of a 30-minute hang;
- at build time the ranks compare a fingerprint of their plans (``agree_on_plan``): a rank that built another plan,
  or failed to build one, is named on every rank before any program runs;
- at call time every input check runs before the first collective, then one small all_reduce tells every rank
  which ranks rejected the call and whether all ranks were called alike (``CallGuard.agree``): a rejection on any
  rank raises on every rank, and the partition stays usable;
- a failure after that point (inside the program) marks the partition unusable (``CallGuard.running``): the next
  call says to rebuild it rather than run on a message stream that may be out of step.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, InputError, PartitionUnusable, RankDisagreement
from .collectives import WAITS

DEFAULT_TIMEOUT = 60.0  # seconds; partition(..., timeout=) overrides
_GROUPS: dict[tuple, "RankGroups"] = {}  # groups are costly to create: reused across partitions of one mesh


@dataclass
class RankGroups:
    """Process groups bounded by ``timeout``: ``world`` spans the mesh (for agreement), ``axes`` maps each mesh dim
    to the name of this rank's group along it (for the program's collectives)."""
    world: dist.ProcessGroup
    axes: dict[str, str]
    timeout: float


def _is_real_backend() -> bool:
    """Agreement needs a process group that moves data; PyTorch's fake one (planning large meshes) does not."""
    return dist.is_initialized() and dist.get_backend() != "fake"


def bounded_groups(axis_names: tuple[str, ...], axis_sizes: tuple[int, ...], timeout: float,
                   runnable: bool = True) -> RankGroups | None:
    """New process groups for a mesh of ``axis_sizes`` over ranks 0..world-1 (row-major), every collective on them
    bounded by ``timeout`` seconds. Every rank must call this in the same order (``dist.new_group`` is collective).
    None for a mesh that is not run (axis sizes) and on the fake process group."""
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf):
        raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not runnable or not _is_real_backend():
        return None
    key = (axis_names, axis_sizes, float(timeout), id(dist.distributed_c10d._get_default_group()))
    if key in _GROUPS:
        return _GROUPS[key]
    bound = timedelta(seconds=timeout)
    rank, world = dist.get_rank(), math.prod(axis_sizes)
    ranks = torch.arange(world).reshape(axis_sizes)
    axes = {}
    for dim, name in enumerate(axis_names):
        for members in ranks.movedim(dim, -1).reshape(-1, axis_sizes[dim]).tolist():
            group = dist.new_group(members, timeout=bound)  # collective: every rank creates every group
            if rank in members:
                axes[name] = group.group_name
    groups = RankGroups(dist.new_group(list(range(world)), timeout=bound), axes, float(timeout))
    _GROUPS[key] = groups
    return groups


def forget(groups: RankGroups) -> None:
    """A timed-out group may hold stale messages: the next partition of the mesh creates fresh ones."""
    for key, cached in list(_GROUPS.items()):
        if cached is groups:
            del _GROUPS[key]


def _exchange(groups: RankGroups, value, what: str) -> list:
    gathered = [None] * dist.get_world_size(groups.world)
    try:
        dist.all_gather_object(gathered, value, group=groups.world)
    except RuntimeError as error:
        forget(groups)
        raise CollectiveTimeout(f"ranks did not all reach {what} within {groups.timeout:g} s: a rank failed before "
                                f"it, hangs, or was not started ({_first_line(error)})") from error
    return gathered


def plan_lines(planned: torch.fx.GraphModule, header: list[str]) -> list[str]:
    """The plan as text, one decision a line: the header (mesh, options), then each node with its placements."""
    lines = list(header)
    for node in planned.graph.nodes:
        placements = node.meta.get("placements", {})
        lines.append(f"{node.name} = {node.format_node()} | {placements}")
    return lines


def agree_on_plan(groups: RankGroups | None, lines: list[str] | None, failure: BaseException | None) -> None:
    """Compare every rank's plan (``lines``) or build failure; raise on every rank if they differ."""
    if groups is None:
        if failure is not None:
            raise failure
        return
    mine = ("failed", f"{type(failure).__name__}: {_first_line(failure)}") if failure is not None else \
        ("plan", hashlib.sha256("\n".join(lines).encode()).hexdigest())
    every = _exchange(groups, mine, "the plan check of partition()")
    failed = {rank: message for rank, (kind, message) in enumerate(every) if kind == "failed"}
    if failed:
        if failure is not None:
            raise failure
        raise RankDisagreement(f"rank(s) {sorted(failed)} failed to partition, so no rank runs: "
                               + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
    if len({digest for _, digest in every}) == 1:
        return
    plans = _exchange(groups, lines, "the plan comparison of partition()")
    differing = [rank for rank, plan in enumerate(plans) if plan != plans[0]]
    rank = differing[0]
    index = next((i for i, (a, b) in enumerate(zip(plans[0], plans[rank])) if a != b),
                 min(len(plans[0]), len(plans[rank])))
    show = lambda plan: plan[index] if index < len(plan) else "<end of plan>"  # noqa: E731
    raise RankDisagreement(
        f"ranks built different plans: rank(s) {differing} differ from rank 0, first at decision {index}:\n"
        f"  rank 0:    {show(plans[0])[:400]}\n  rank {rank}: {show(plans[rank])[:400]}\n"
        "every rank must call partition with the same model, example input shapes and options")


def value_digest(tensor: torch.Tensor) -> str:
    """A tensor's values in a short string (for inputs a partition is specialised on: masks, lengths)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def call_signature(values: list, exact=()) -> int:
    """A number that is equal on two ranks when their calls have the same shapes, dtypes and constants, and the
    same values at the indices in ``exact``."""
    described = [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v) for v in values]
    described += [value_digest(values[i]) for i in sorted(exact)]
    return int.from_bytes(hashlib.sha256(repr(described).encode()).digest()[:7], "little")


class CallGuard:
    """Wraps every call of a lowered program: ``agree`` before the first collective, ``running`` around it."""

    def __init__(self, groups: RankGroups | None, device: torch.device):
        self.groups = groups
        self.device = device if groups is not None and dist.get_backend(groups.world) != "gloo" else \
            torch.device("cpu")
        self.broken: str | None = None

    @property
    def group(self):
        return self.groups.world if self.groups is not None else None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise PartitionUnusable(f"an earlier call failed after its first collective ({self.broken}); the ranks' "
                                    "message streams may be out of step: partition the model again on every rank")

    def agree(self, problem: InputError | None, signature: int, describe=None) -> None:
        """One all_reduce: which ranks rejected this call, and whether every rank's call looks alike (``signature``;
        ``describe()``: the call's shapes in words, exchanged only when the signatures differ)."""
        self.check_usable()
        if self.groups is None:
            if problem is not None:
                raise problem
            return
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        status = torch.zeros(world, 2, dtype=torch.int64, device=self.device)
        status[rank, 0] = int(problem is not None)
        status[rank, 1] = signature
        try:
            dist.all_reduce(status, group=self.group)
        except RuntimeError as error:
            self.broken = f"the input agreement timed out: {_first_line(error)}"
            forget(self.groups)
            raise CollectiveTimeout(f"ranks did not all call the partition within {self.groups.timeout:g} s "
                                    f"({_first_line(error)}); every rank must make every call") from error
        status = status.cpu()
        rejected = status[:, 0].nonzero().flatten().tolist()
        if rejected:
            reasons = _exchange(self.groups, str(problem) if problem is not None else None, "the input agreement")
            summary = "; ".join(f"rank {r}: {reasons[r]}" for r in rejected)
            if problem is not None:
                raise InputError(f"rank(s) {rejected} rejected this call, so no rank runs it: {summary}") from problem
            raise InputError(f"rank(s) {rejected} rejected this call, so no rank runs it: {summary}")
        signatures = status[:, 1].tolist()
        if len(set(signatures)) > 1:
            odd = [r for r, s in enumerate(signatures) if s != signatures[0]]
            calls = _exchange(self.groups, describe() if describe is not None else "", "the input agreement")
            differ = "; ".join(f"rank {r}: {calls[r]}" for r in [0, *odd] if calls[r])
            raise InputError(f"rank(s) {odd} were called with other input shapes, dtypes or options than rank 0"
                             + (f" ({differ})" if differ else "")
                             + "; every rank must make the same call (its own data, the same shapes)")

    @contextlib.contextmanager
    def running(self, programs: list[torch.fx.GraphModule]):
        """Run the program; on any failure mark the partition unusable and name the collective that timed out."""
        self.check_usable()
        try:
            yield
        except BaseException as error:
            if self.groups is None:  # one process drives every device (or plans only): nothing is out of step
                raise
            where = failing_node(error, programs)
            self.broken = f"{type(error).__name__} at {where or 'an unknown node'}: {_first_line(error)}"
            forget(self.groups)
            if where is not None and _is_collective_failure(error, where):
                raise CollectiveTimeout(f"{describe_collective(where)} did not complete within "
                                        f"{self.groups.timeout:g} s, or failed: a peer rank "
                                        f"failed or hangs ({_first_line(error)}); partition the model again on every "
                                        "rank") from error
            raise


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
    waits_for_one = node.target in WAITS and "collective" in getattr(node.args[0], "meta", {})
    return "collective" in node.meta or waits_for_one or isinstance(error, getattr(dist, "DistBackendError", ())) \
        or "timed out" in str(error).lower() or "timeout" in str(error).lower()


def describe_collective(node: torch.fx.Node) -> str:
    if "collective" in node.meta:
        kind, axis = node.meta["collective"]
        return f"the {kind} {node.name} over mesh dim {axis!r}"
    if node.target in WAITS:
        source = node.args[0]
        if "collective" in source.meta:
            return describe_collective(source)
    return f"a collective inside {node.name}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


__all__ = ["CallGuard", "DEFAULT_TIMEOUT", "RankGroups", "agree_on_plan", "bounded_groups",
           "call_signature", "plan_lines"]
