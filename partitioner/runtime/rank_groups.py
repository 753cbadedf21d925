"""The process groups a partition runs on: created with a bounded ``timeout`` so that a peer that never arrives is a
``CollectiveTimeout``, not a hang, and reused by a decision every rank takes alike (``bounded_groups``): the ranks
meet in the default group's store and create fresh groups when any rank saw its groups fail. What a rank keeps is
per default process group (a group made after ``destroy_process_group`` starts afresh) and held weakly."""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, InputError

DEFAULT_TIMEOUT = 60.0  # seconds; partition(..., timeout=) overrides


@dataclass
class _Meshes:
    """What this rank keeps per default process group (dropped with it: a group made after destroy_process_group
    starts afresh, even where Python reuses the old one's id)."""
    epoch: int  # which default group this is on the store (a store can outlive groups: torchrun's agent store)
    groups: dict[tuple, "RankGroups"] = field(default_factory=dict)  # costly to create: reused across partitions
    rounds: dict[tuple, int] = field(default_factory=dict)  # how many times this rank met its peers, per mesh


_BY_DEFAULT_GROUP: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Meshes]" = weakref.WeakKeyDictionary()


@dataclass
class RankGroups:
    """Process groups bounded by ``timeout``: ``world`` spans the mesh (for agreement), ``axes`` maps each mesh dim
    to the name of this rank's group along it (for the program's collectives). The groups are held weakly: torch
    holds them until ``destroy_process_group``, and then nothing of a partition (fx graphs are cyclic garbage, freed
    only by a full collection) keeps their threads and connections alive."""
    world_ref: weakref.ref
    axes: dict[str, str]
    timeout: float
    generation: int = 1  # how many times the ranks created groups for this mesh; compared in the plan check
    stale: bool = False  # a collective on them failed or timed out on this rank: they may hold stale messages
    # held by the thread running a call on these groups: a second thread's call is refused, not interleaved
    calls: threading.RLock = field(default_factory=threading.RLock, compare=False, repr=False)
    owned: list[weakref.ref] = field(default_factory=list, repr=False)  # this rank's groups, destroyed if replaced
    built: int = 0  # partitions agreed on these groups (in the same order on every rank): each one's number

    @property
    def world(self) -> dist.ProcessGroup | None:
        """The group spanning the mesh; None once destroyed."""
        return self.world_ref()

    @property
    def alive(self) -> bool:
        world = self.world
        return world is not None and world in getattr(dist.distributed_c10d._world, "pg_map", {world: 0})


def _is_real_backend() -> bool:
    """Agreement needs a process group that moves data; PyTorch's fake one (planning large meshes) does not."""
    return dist.is_initialized() and dist.get_backend() != "fake"


def bounded_groups(axis_names: tuple[str, ...], axis_sizes: tuple[int, ...], timeout: float,
                   runnable: bool = True) -> RankGroups | None:
    """Process groups for a mesh of ``axis_sizes`` over ranks 0..world-1 (row-major), every collective on them
    bounded by ``timeout`` seconds. Every rank must call this in the same order (``dist.new_group`` is collective).
    The groups of an earlier partition of the mesh are reused unless any rank saw them fail (``stale``): the ranks
    first meet in the default group's store (``_meet``) and take the same decision, so that no rank creates new
    groups while another reuses the old ones. None for a mesh that is not run (axis sizes) and on the fake process
    group."""
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf):
        raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not runnable or not _is_real_backend():
        return None
    try:
        default = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError) as error:
        raise CollectiveTimeout(f"no default process group to partition on ({first_line(error)}): call "
                                "torch.distributed.init_process_group on every rank first") from None
    meshes = _BY_DEFAULT_GROUP.get(default)
    if meshes is None:  # every rank counts itself in once per default group: the same epoch on every rank
        arrivals = dist.distributed_c10d._get_default_store().add("partitioner/epochs", 1)
        meshes = _BY_DEFAULT_GROUP[default] = _Meshes(epoch=(arrivals - 1) // dist.get_world_size())
    key = (axis_names, axis_sizes, float(timeout))
    cached = meshes.groups.get(key)
    mine = (cached.generation if cached is not None else 0, cached is None or cached.stale, float(timeout))
    every = _meet(meshes, (axis_names, axis_sizes), mine, timeout)  # ranks with other timeouts meet too
    if len({entry[2] for entry in every}) > 1:
        raise InputError("the ranks gave partition() different timeouts ("
                         + ", ".join(f"rank {r}: {entry[2]:g} s" for r, entry in enumerate(every))
                         + "); every collective of a partition waits as long on every rank: give each rank the same "
                         "timeout")
    if cached is not None and all(entry[:2] == (cached.generation, False) for entry in every):
        return cached  # every rank holds the same healthy groups
    if cached is not None:  # replaced on every rank: its threads and connections go now, not at exit
        _destroy(meshes.groups.pop(key).owned)
    generation = max(entry[0] for entry in every) + 1  # the same number on every rank
    bound = timedelta(seconds=timeout)
    rank, world = dist.get_rank(), math.prod(axis_sizes)
    ranks = torch.arange(world).reshape(axis_sizes)
    axes, owned = {}, []
    try:
        for dim, name in enumerate(axis_names):
            for members in ranks.movedim(dim, -1).reshape(-1, axis_sizes[dim]).tolist():
                group = dist.new_group(members, timeout=bound)  # collective: every rank creates every group
                if rank in members:
                    axes[name] = group.group_name
                    owned.append(group)
        world_group = dist.new_group(list(range(world)), timeout=bound)
    except RuntimeError as error:
        _destroy([weakref.ref(group) for group in owned])
        raise CollectiveTimeout(f"creating the partition's process groups did not complete within {timeout:g} s on "
                                f"rank {rank}: a peer rank failed, hangs, or did not call partition() "
                                f"({first_line(error)}); call partition() again on every rank") from error
    groups = RankGroups(weakref.ref(world_group), axes, float(timeout), generation,
                        owned=[weakref.ref(group) for group in owned + [world_group]])
    meshes.groups[key] = groups
    return groups


def _destroy(owned: list[weakref.ref]) -> None:
    """Destroy the groups a partition made on this rank (those still alive and registered)."""
    registered = getattr(dist.distributed_c10d._world, "pg_map", {})
    for group in (ref() for ref in owned):
        if group is not None and group in registered:
            dist.destroy_process_group(group)


def _meet(meshes: _Meshes, key: tuple, value: tuple[int, bool, float], timeout: float) -> list[tuple[int, bool, float]]:
    """Every rank's ``value`` for this round of ``bounded_groups`` on the mesh ``key``, exchanged through the default
    group's store (keys, not messages: nothing stale can pair with them). Each rank sets its key and counts itself
    in; the last to arrive marks the round complete, a rank that waited ``timeout`` in vain marks it abandoned:
    one atomic compare-and-set decides, so every rank reads the same outcome. On an abandoned round every rank that
    was in it raises ``CollectiveTimeout`` naming the ranks that did not come; a rank that arrives after it was
    abandoned joins the next round instead, which its peers' next ``partition()`` meets."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    while True:
        meshes.rounds[key] = round_ = meshes.rounds.get(key, 0) + 1
        prefix = f"partitioner/groups/{meshes.epoch}/{mesh}/{round_}/"
        state = prefix + "state"
        if store.check([state]) and store.get(state) == b"abandoned":
            continue  # its peers gave up on this round before this rank came: their next partition() is the next
        keys = [prefix + str(r) for r in range(world)]
        store.set(keys[rank], f"{value[0]} {int(value[1])} {value[2]!r}")
        if store.add(prefix + "arrived", 1) == world:
            store.compare_set(state, "", "complete")
        try:
            store.wait([state], timedelta(seconds=timeout))
        except RuntimeError:
            store.compare_set(state, "", "abandoned")  # (unless the last rank completed it meanwhile)
        if store.get(state) == b"abandoned":
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise CollectiveTimeout(
                f"rank(s) {missing or 'of the mesh'} did not call partition() within {timeout:g} s of rank {rank} "
                f"(round {round_} of this mesh's process groups): they failed, hang, or skipped it; call "
                "partition() again on every rank")
        return [(int(g), bool(int(stale)), float(wait)) for g, stale, wait in (store.get(k).decode().split()
                                                                               for k in keys)]


def forget(groups: RankGroups) -> None:
    """A timed-out group may hold stale messages: the next partition of the mesh creates fresh ones, on every rank
    (``bounded_groups`` tells the peers)."""
    groups.stale = True


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


__all__ = ["DEFAULT_TIMEOUT", "RankGroups", "bounded_groups", "first_line", "forget"]
