"""Reading XLA's partitioned HLO text: its collectives with their replica groups, the mesh axis whose process groups
those are, and how they differ from the plan's collectives."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import torch

_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.*?)\s(all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}")


@dataclass(frozen=True)
class HloCollective:
    name: str  # the HLO instruction
    kind: str  # all_reduce, all_gather, all_to_all, collective_permute, reduce_scatter
    groups: tuple[tuple[int, ...], ...]  # replica groups (collective_permute: source-target pairs)
    shape: str  # of its result, as HLO writes it


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    if match := _IOTA_GROUPS.search(line):
        count, size, dims, perm = match.groups()
        ids = torch.arange(math.prod(map(int, dims.split(",")))).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.permute([int(p) for p in perm.split(",")])
        return tuple(map(tuple, ids.reshape(int(count), int(size)).tolist()))
    match = _LIST_GROUPS.search(line) or _PAIRS.search(line)
    if not match:
        return ()
    return tuple(tuple(int(x) for x in group.split(",") if x) for group in re.findall(r"\{([\d,]*)\}", match.group(1)))


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective of an HLO module's text, with its replica groups."""
    found = []
    for line in hlo_text.splitlines():
        if match := _COLLECTIVE.match(line):
            name, shape, kind = match.groups()
            found.append(HloCollective(name, kind.replace("-", "_"), _groups(line), shape))
    return found


def axis_of(groups, mesh) -> str:
    """The mesh axis whose process groups are ``groups``, else a description of the groups. No groups (HLO's
    ``replica_groups={}``) means all devices."""
    normalized = sorted(sorted(group) for group in groups) or [list(range(mesh.world_size))]
    for axis in mesh.axis_names:
        if sorted(mesh.groups(axis)) == normalized:
            return axis
    if normalized == [list(range(mesh.world_size))]:
        return "all"
    return f"groups {normalized}"


def ring_of(pairs, mesh) -> str | None:
    """The mesh axis whose groups ``pairs`` (a collective-permute's source-target pairs) pass a block round, each
    rank to its next (or previous) in every group of the axis: a ring attention's step."""
    return _passed_along(pairs, mesh, wrap=True)


def neighbours_of(pairs, mesh) -> str | None:
    """The mesh axis whose groups ``pairs`` pass rows one way between neighbours, without wrapping round: one
    direction of a convolution's halo exchange."""
    return _passed_along(pairs, mesh, wrap=False)


def _passed_along(pairs, mesh, wrap: bool) -> str | None:
    for axis in mesh.axis_names:
        groups = mesh.groups(axis)
        if len(groups[0]) < 2:
            continue
        forward = {(g[i], g[(i + 1) % len(g)]) for g in groups for i in range(len(g) if wrap else len(g) - 1)}
        if set(map(tuple, pairs)) in (forward, {(b, a) for a, b in forward}):
            return axis
    return None


def plan_key(collective: HloCollective, mesh) -> tuple[str, str]:
    """(kind, axis) as the plan counts collectives: a collective-permute between ring neighbours is a ring pass,
    one between neighbours that does not wrap round a direction of a halo exchange ("halo_direction": the plan's
    one halo exchange is two of them); any other permute is counted apart ("pairs"), the plan having none."""
    if collective.kind == "collective_permute":
        axis = ring_of(collective.groups, mesh)
        if axis:
            return "ring_pass", axis
        axis = neighbours_of(collective.groups, mesh)
        return ("halo_direction", axis) if axis else ("collective_permute", "pairs")
    return collective.kind, axis_of(collective.groups, mesh)


def _joint_axes(groups, mesh) -> list[str] | None:
    """The mesh axes (two or more, adjacent in mesh order) whose joint groups are ``groups``: XLA gathers a dim
    that several axes shard in one all-gather over all of their devices, where the plan gathers axis by axis."""
    normalized = sorted(sorted(group) for group in groups) or [list(range(mesh.world_size))]
    names = mesh.axis_names
    for start in range(len(names)):
        for end in range(start + 2, len(names) + 1):
            if sorted(sorted(g) for g in mesh.joint_groups(names[start:end])) == normalized:
                return [axis for axis in names[start:end] if mesh.size(axis) > 1]
    return None


def compare(found: list[HloCollective], planned: Counter, mesh) -> list[str]:
    """Differences between XLA's collectives and the plan's ((kind, axis) -> count), as readable lines. One
    all-gather over several axes' joint groups, which the plan does not have as such, counts as the plan's gather
    over each of those axes."""
    halos = {axis for kind, axis in planned if kind == "halo_exchange"}
    keys = {}
    for c in found:  # a one-way permute between neighbours is a halo's only where the plan has a halo exchange
        key = plan_key(c, mesh)
        keys[id(c)] = ("collective_permute", "pairs") if key[0] == "halo_direction" and key[1] not in halos else key
    got = Counter()
    for c in found:
        key = keys[id(c)]
        joint = _joint_axes(c.groups, mesh) if c.kind == "all_gather" and key[1] not in mesh.axis_names \
            and not planned.get(key) else None
        for each in ([("all_gather", axis) for axis in joint] if joint else [key]):
            got[each] += 1
    planned = Counter(planned)
    for (kind, axis), count in list(planned.items()):
        if kind == "halo_exchange":  # XLA sends each way on its own
            planned[("halo_direction", axis)] += 2 * planned.pop((kind, axis))
    problems = []
    for key in sorted(set(got) | set(planned)):
        if got[key] == planned[key]:
            continue
        kind, axis = key
        line = f"{kind} over {axis}: XLA has {got[key]}, the plan {planned[key]}"
        if got[key] > planned[key]:
            extra = [c for c in found if keys[id(c)] == key]
            line += "; XLA's: " + ", ".join(f"{c.name} {c.shape} {[list(g) for g in c.groups]}" for c in extra[:8])
        problems.append(line)
    return problems
