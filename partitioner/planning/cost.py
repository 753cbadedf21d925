"""A physical step-time model of one rank's partitioned graph on a device described by data (``DeviceProfile``).

    step = compute + exposed communication

- compute, node by node: a matmul (linear, mm/bmm, attention, a ring attention's blocks) takes the longer of its
  FLOPs at the device's sustained matmul rate and its bytes at the memory bandwidth; every other op that makes a
  tensor (norms, modulation, residual adds, copies) its bytes read and written at the memory bandwidth. Views are
  free.
- communication, collective by collective, from its bytes, its algorithm and where its ranks sit: ranks fill chips
  (``ranks_per_chip`` consecutive ranks share a package and its fast local fabric), chips talk over links.
  A group inside one chip moves its bytes at ``local_gbps``. A group spanning k chips runs hierarchically:
  the ranks of a chip combine locally, then the chips run the algorithm among themselves, and every group of the
  same axis does so at the same time, so a chip's link carries the traffic of all its ranks' groups. Bytes on one
  chip's link per call, for b result bytes per rank, m of the group's ranks per chip and c groups per chip:

      all_reduce (ring over chips)   c x 2(k-1)/k x b        all_gather      c x (k-1)/k x b
      all_to_all (pairwise)          c x m(n-m)/n x b        ring pass       c x b (one rank per chip sends on)

  plus a per-message latency for each step of the algorithm (ring all-reduce 2(n-1), all-gather and all-to-all
  n-1, a ring pass 1). A reduce-scatter costs the profile's ``reduce_scatter_share`` of an all-reduce of its input
  (a ring's first half: 0.5; gloo's measured 1.0).
- overlap, in the graph's order (``schedule_collectives`` sets it): a functional collective with its own wait is
  hidden by the compute between its issue and its wait, one collective on the link at a time; a ring attention's
  next key/value block travels while this block's attention runs, so a pass costs only what its transfer exceeds
  that compute by; the package's other collectives are waited on at once (exposed).

This is why Ulysses on Trainium2 gains less than its compute suggests: TP=8 x Ulysses=4 puts the 4 Ulysses ranks of
a tensor-parallel shard on one chip (all-to-all stays local) and spreads each TP group over 8 chips, so each chip's
link carries 4 TP groups' all-reduces: TP communication per rank falls 4x, its time does not.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.fx import GraphModule
from ..annotations import annotation

aten = torch.ops.aten
PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    matmul_tflops: float  # sustained dense matmul rate of one rank's device, TFLOP/s
    memory_gbps: float  # memory bandwidth of one rank, GB/s
    memory_bytes: int  # device memory of one rank
    ranks_per_chip: int  # consecutive ranks sharing one package (and its local fabric)
    local_gbps: float  # bandwidth between the ranks of one chip, per rank, GB/s
    link_gbps: float  # bandwidth a chip's collective traffic leaves it at (one ring direction), GB/s
    latency_us: float  # per message (one step of a collective algorithm)
    # share of a collective's time that compute running meanwhile can hide: 1 where collectives move data on
    # engines of their own; a CPU gloo run reduces on the cores it computes on (calibrate measures it)
    overlap: float = 1.0
    # a reduce-scatter's time as a share of an all_reduce of the same input: half on a ring (its first half);
    # gloo's costs as much as the all_reduce (calibrate measures it)
    reduce_scatter_share: float = 0.5
    sources: dict[str, str] = field(default_factory=dict)  # where each figure comes from

    def __post_init__(self):
        from ..errors import InputError

        figures = ("matmul_tflops", "memory_gbps", "memory_bytes", "ranks_per_chip", "local_gbps", "link_gbps")
        bad = [f"{name}={getattr(self, name)!r}" for name in figures if not getattr(self, name) > 0]
        if self.latency_us < 0:
            bad.append(f"latency_us={self.latency_us!r}")
        if not 0 <= self.overlap <= 1:
            bad.append(f"overlap={self.overlap!r} (a share, from 0 to 1)")
        if not 0 < self.reduce_scatter_share <= 1:
            bad.append(f"reduce_scatter_share={self.reduce_scatter_share!r} (a share, above 0, at most 1)")
        if bad:
            raise InputError(f"device profile {self.name!r}: {', '.join(bad)}; every figure must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def load_profile(name_or_path: "str | Path | DeviceProfile") -> DeviceProfile:
    """A profile by name (``trn2``, ``h100-nvlink``, ``h200-nvlink``, ``cpu-gloo``: ``partitioner/planning/profiles``) or
    from a JSON file (``partitioner calibrate`` writes one)."""
    from ..errors import InputError

    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES.glob("*.json"))
        raise InputError(f"no device profile {str(name_or_path)!r}: use one of {known} or a JSON file written by "
                         "`partitioner calibrate`")
    data = json.loads(path.read_text())
    try:
        return DeviceProfile(**data)
    except TypeError as error:
        raise InputError(f"{path}: not a device profile ({error})") from None


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float  # every collective's time, as if nothing overlapped it
    exposed_comm_s: float  # the part the program waits for
    flops: float
    memory_bytes: float  # bytes moved by memory-bound ops and matmuls' operands
    comm_by_kind: dict[str, float] = field(default_factory=dict)  # kind -> seconds

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


# ---- compute ----

def matmul_flops(node) -> float:
    """FLOPs of a matmul node; 0 for anything else. A ring attention's keys are the whole ring's."""
    from ..runtime.collectives import ring_attention

    if node.target is aten.linear.default:
        return 2 * node.meta["val"].numel() * node.args[1].meta["val"].shape[1]
    if node.target in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                       aten.matmul.default):
        a = node.args[-2].meta["val"]
        return 2 * node.meta["val"].numel() * a.shape[-1]
    if node.target in (aten.scaled_dot_product_attention.default, ring_attention):
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        keys = sum(node.args[4]) if node.target is ring_attention else k.shape[-2]
        return 4 * q.shape[:-2].numel() * q.shape[-2] * keys * q.shape[-1]
    return 0.0


def _only_moves_data(node) -> bool:
    """A collective that computes nothing (sharded norms and ring attention compute as well as communicate)."""
    from ..runtime import collectives as c

    return node.target in (*c.STARTS, *c.WAITS) or "_c10d_functional" in str(node.target)


def node_compute_s(node, profile: DeviceProfile) -> tuple[float, float, float]:
    """(seconds, flops, bytes) of one node's computation on ``profile`` (roofline: the slower of the two)."""
    from .report import aliases, nbytes

    if node.op != "call_function" or aliases(node) or _only_moves_data(node):
        return 0.0, 0.0, 0.0
    flops = matmul_flops(node)
    moved = nbytes(node.meta.get("val")) + sum(nbytes(n.meta.get("val")) for n in node.all_input_nodes)
    seconds = max(flops / (profile.matmul_tflops * 1e12), moved / (profile.memory_gbps * 1e9))
    return seconds, flops, moved


# ---- communication ----

# (a halo exchange sends to and receives from both neighbours at once: one step, as a ring pass)
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "all_to_all": lambda n: n - 1,
         "ring_pass": lambda n: 1, "halo_exchange": lambda n: 1}
_LOCAL = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "all_to_all": lambda n: (n - 1) / n, "ring_pass": lambda n: 1.0, "halo_exchange": lambda n: 1.0}


def collective_s(kind: str, result_bytes: float, group: list[int], groups: list[list[int]],
                 profile: DeviceProfile) -> float:
    """Seconds of one call of a collective over ``group`` (global ranks) moving ``result_bytes`` per rank, while
    every group of its axis (``groups``) runs the same call. Where a group's ranks sit unevenly on its chips, the
    busiest chip sets the time."""
    n = len(group)
    if n == 1:
        return 0.0
    if kind == "reduce_scatter":  # (``result_bytes``: what it sums)
        return profile.reduce_scatter_share * collective_s("all_reduce", result_bytes, group, groups, profile)
    chips = Counter(rank // profile.ranks_per_chip for rank in group)
    k = len(chips)
    busiest, m = chips.most_common(1)[0]
    latency = STEPS[kind](n) * profile.latency_us * 1e-6
    if k == 1:
        return latency + result_bytes * _LOCAL[kind](n) / (profile.local_gbps * 1e9)
    # the groups of this axis with ranks on the busiest chip share its link
    concurrent = sum(any(rank // profile.ranks_per_chip == busiest for rank in g) for g in groups)
    per_chip = {"all_reduce": 2 * (k - 1) / k, "all_gather": (k - 1) / k, "all_to_all": m * (n - m) / n,
                "ring_pass": 1.0, "halo_exchange": 1.0}[kind] * result_bytes
    neighbours = kind in ("ring_pass", "halo_exchange")
    local = result_bytes * _LOCAL[kind](m) / (profile.local_gbps * 1e9) if m > 1 and not neighbours else 0.0
    return latency + local + concurrent * per_chip / (profile.link_gbps * 1e9)


def step_time(gm: GraphModule, mesh, profile: DeviceProfile) -> StepTime:
    """The step time of this rank's graph (``mesh``: its MeshSpec, for the groups' ranks), in the graph's order:
    a clock advances by each node's compute; a collective starts when it is issued and the link is free (one
    collective at a time), a synchronous one is waited on at once and an asynchronous one (a functional collective
    with its own wait) only at its wait, so the compute scheduled between them covers it (the profile's
    ``overlap`` share of it: the rest of that time the two contend)."""
    from ..runtime.collectives import WAITS, ring_attention
    from .report import collective_calls

    compute = flops = moved = comm = 0.0
    clock = link_free = 0.0
    flights = {}  # issued asynchronous collective -> (when it starts, when it arrives, compute done at its issue)
    by_kind: dict[str, float] = {}
    groups = {axis: mesh.groups(axis) for axis in mesh.axis_names}
    for node in gm.graph.nodes:
        seconds, node_flops, node_bytes = node_compute_s(node, profile)
        compute, flops, moved = compute + seconds, flops + node_flops, moved + node_bytes
        if node.target in WAITS and node.args[0] in flights:
            start, end, computed = flights.pop(node.args[0])
            overlapped = min(compute - seconds - computed, end - start)  # compute that ran while it was in flight
            clock = max(clock, end) + (1 - profile.overlap) * max(0.0, overlapped)
        if annotation(node).collective is None:
            clock += seconds
            continue
        kind, axis = annotation(node).collective
        size, calls = collective_calls(node)
        mine = next(g for g in groups[axis] if mesh.rank in g)
        one = collective_s(kind, size, mine, groups[axis], profile)
        comm += one * calls
        by_kind[kind] = by_kind.get(kind, 0.0) + one * calls
        start = max(clock, link_free)
        if node.target is ring_attention:  # each pass hides behind one block's attention
            clock = start + seconds + calls * max(0.0, one - seconds / len(node.args[4]))
            link_free = clock
        elif any(user.target in WAITS for user in node.users):
            link_free = start + one * calls
            flights[node] = (start, link_free, compute)
        else:
            clock = link_free = start + one * calls + seconds
    return StepTime(compute, comm, max(0.0, clock - compute), flops, moved, by_kind)


def with_overrides(profile: DeviceProfile, **figures) -> DeviceProfile:
    """The profile with some figures replaced (None: kept), e.g. ``matmul_tflops`` from ``--tflops``."""
    given = {name: value for name, value in figures.items() if value is not None}
    if not given:
        return profile
    return replace(profile, **given, name=f"{profile.name} ({', '.join(f'{k}={v}' for k, v in given.items())})",
                   sources={**profile.sources, **{name: "given" for name in given}})


__all__ = ["DeviceProfile", "StepTime", "collective_s", "load_profile", "matmul_flops", "node_compute_s",
           "step_time", "with_overrides"]
