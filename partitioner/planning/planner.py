"""Deployment planning on meta weights: what one rank holds and moves under a (tp, ring, ulysses) layout, whether
it fits a device, and a search over layouts ranked by a physical step-time model. No weight is ever allocated.

Each layout is partitioned for rank 0 (the largest share where splits are uneven) and its graph costed by
``partitioner/planning/cost.py`` on a device profile (``partitioner/planning/profiles/*.json``, or one ``partitioner calibrate``
wrote): compute from FLOPs and bytes at the device's sustained rates, communication from each collective's bytes,
algorithm and the chips its ranks sit on, exposed where the program waits for it. Default profile: one logical
NeuronCore of a trn2 host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..build import partition_traced
from ..errors import InputError, InvariantError, PartitionError
from ..frontend.model_source import ALIASES as MODELS
from ..frontend.model_source import apply_dtype, build_model  # noqa: F401  (apply_dtype: for existing callers)
from ..frontend.pipeline_inputs import h3_inputs
from ..frontend.trace import copy_graph_module
from ..mesh import as_mesh_spec
from ..passes.context import Overlap
from ..progress import bar, inner_steps_quiet
from . import cost, extrapolate

DEFAULT_PROFILE = "trn2"


@dataclass
class LayoutEstimate:
    tp: int
    ulysses: int
    replicas: int  # devices / (tp x ring x ulysses): independent copies, one request each
    parameter_bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes on rank 0
    parameter_count: int = 0  # parameter elements on rank 0
    # the ranks with the most and the fewest parameter bytes (uneven splits): {"largest": {"rank",
    # "parameter_count", "bytes"}, "smallest": ...}
    parameter_ranks: dict[str, dict[str, int]] = field(default_factory=dict)
    activation_bytes: int = 0
    collective_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes per step on one rank
    flops: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0  # every collective's time
    exposed_comm_s: float = 0.0  # the part of it the program waits for
    comm_s_by_kind: dict[str, float] = field(default_factory=dict)
    device_memory: int | None = None
    error: str | None = None  # why this layout is impossible
    ring: int = 1
    profile: str = DEFAULT_PROFILE
    # every rank's parameter elements and bytes: [{"rank", "parameter_count", "parameter_bytes"}]
    ranks: list[dict[str, int]] = field(default_factory=list)
    extrapolated_from: int | None = None  # the chain's block count, where costed from cuts to 2 and 3 blocks
    pruned: str | None = None  # why the search did not cost it: its compute alone is slower than the best found

    @property
    def layout(self) -> str:
        return " x ".join(f"{axis}={size}" for axis, size in (("tp", self.tp), ("ring", self.ring),
                                                              ("ulysses", self.ulysses)) if size > 1 or axis == "tp")

    @property
    def memory_bytes(self) -> int:
        """The fullest rank's parameters plus rank 0's activations (rank 0 takes the larger part of every uneven
        split, so it is the fullest rank too)."""
        largest = self.parameter_ranks.get("largest", {}).get("bytes", 0)
        return max(sum(self.parameter_bytes.values()), largest) + self.activation_bytes

    @property
    def step_s(self) -> float:
        """The estimate; for a pruned layout, the lower bound it was pruned by."""
        return self.compute_s + self.exposed_comm_s

    @property
    def requests_per_s(self) -> float:
        """Throughput of all replicas together (the search ranks by step time, i.e. latency)."""
        return self.replicas / self.step_s if self.step_s else 0.0

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory_bytes <= self.device_memory

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layout": self.layout, "memory_bytes": self.memory_bytes,
                "step_s": self.step_s, "requests_per_s": self.requests_per_s, "fits": self.fits,
                "largest_rank": self.largest_rank()}

    def largest_rank(self) -> dict[str, int]:
        """The rank holding the most parameter bytes (``parameter_ranks``), with the memory that must fit (rank
        0's activations: rank 0 takes the larger part of every uneven split)."""
        largest = self.parameter_ranks.get("largest")
        if not largest:
            return {}
        return {"rank": largest["rank"], "parameter_count": largest["parameter_count"],
                "parameter_bytes": largest["bytes"], "activation_bytes": self.activation_bytes,
                "memory_bytes": self.memory_bytes}


def parse_bytes(text: str) -> int:
    """'24GiB', '24G' (binary, as memory is sold), '1.5GB' (decimal), '512' (bytes)."""
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "TB": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number = text.strip().upper().rstrip()
    for unit in sorted(units, key=len, reverse=True):
        if unit and number.endswith(unit):
            return int(float(number[: -len(unit)]) * units[unit])
    return int(float(number))


def build_meta_model(model: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model by name (``minimax-h3``: the full 33B configuration; or a diffusers class name, at its defaults) or
    from a diffusers config.json (or the folder holding it), on the meta device (``partition`` computes the
    non-persistent buffers it needs)."""
    if model in MODELS or not ("/" in model or model.endswith(".json") or Path(model).exists()):
        return build_model(model, dtype=dtype)
    return build_model(None, [model], dtype=dtype)


def example_inputs(model: torch.nn.Module, seq_len: int, dtype: torch.dtype = torch.bfloat16):
    """Meta inputs of one packed request of ``seq_len`` rows. For MiniMax-H3: 512 text rows (fewer for short
    sequences), 1/74 of the rows audio, the rest video, two distinct timesteps."""
    if type(model).__name__ != "MiniMaxH3Transformer3DModel":
        raise InputError(f"no input layout is known for {type(model).__name__}; use the Python API with your own "
                         "example_inputs")
    text = min(512, seq_len // 4)
    audio = max(1, seq_len // 74)
    inputs = h3_inputs(dict(model.config), text=text, video=seq_len - text - audio, audio=audio, device="meta")
    return ((), {k: v.to(dtype) if v.is_floating_point() and k != "timestep" else v for k, v in inputs.items()})


def partition_layout(traced, model_name: str, tp: int, ulysses: int, ring: int = 1,
                     profile: cost.DeviceProfile | None = None):
    """A copy of ``traced`` partitioned for rank 0 of a (tp, ring, ulysses) mesh (Ulysses innermost), its
    communication overlapped as ``profile``'s costs say (the one the layout is costed on)."""
    mesh = as_mesh_spec({"tp": tp, "ring": ring, "ulysses": ulysses}, rank=0)
    return partition_traced(dataclasses.replace(traced, graph_module=copy_graph_module(traced.graph_module)), mesh,
                            model_name, overlap=Overlap(profile=profile or DEFAULT_PROFILE))


def estimate(traced, model_name: str, tp: int, ulysses: int, devices: int | None = None,
             profile: cost.DeviceProfile | None = None, device_memory: int | None = None,
             ring: int = 1) -> LayoutEstimate:
    """Partition a copy of ``traced`` for rank 0 (the largest share where splits are uneven) and cost it."""
    profile = profile or cost.load_profile(DEFAULT_PROFILE)
    try:
        partitioned = partition_layout(traced, model_name, tp, ulysses, ring, profile)
    except PartitionError as error:
        ranks = tp * ring * ulysses
        return LayoutEstimate(tp, ulysses, (devices or ranks) // ranks, device_memory=device_memory, ring=ring,
                              error=str(error), profile=profile.name)
    return cost_of(partitioned, devices, profile, device_memory)


def cost_of(partitioned, devices: int | None = None, profile: cost.DeviceProfile | None = None,
            device_memory: int | None = None) -> LayoutEstimate:
    """What rank 0 of a partition holds, moves and spends per step on ``profile``."""
    profile = profile or cost.load_profile(DEFAULT_PROFILE)
    mesh = partitioned.mesh
    ranks = mesh.world_size
    result = LayoutEstimate(mesh.size("tp"), mesh.size("ulysses"), (devices or ranks) // ranks,
                            device_memory=device_memory, ring=mesh.size("ring"), profile=profile.name)
    report = partitioned.report()
    result.parameter_bytes = report.parameter_bytes
    result.parameter_count = report.parameters
    result.parameter_ranks = report.parameter_extremes()
    result.ranks = [{"rank": r, "parameter_count": n, "parameter_bytes": size}
                    for r, (n, size) in enumerate(report.rank_parameters)]
    result.activation_bytes = report.activation_peak_bytes
    for c in report.collectives:
        result.collective_bytes[c.kind] = result.collective_bytes.get(c.kind, 0) + c.count * c.bytes_per_call
    step = cost.step_time(partitioned.graph_module, mesh, profile)
    result.flops, result.compute_s = step.flops, step.compute_s
    result.comm_s, result.exposed_comm_s, result.comm_s_by_kind = step.comm_s, step.exposed_comm_s, step.comm_by_kind
    return result


def layouts(devices: int, ring: bool = True) -> list[tuple[int, int, int]]:
    """Every (tp, ring, ulysses) whose product divides ``devices`` (the rest are replicas); ring 1 only when
    ``ring`` is false."""
    return [(tp, r, u) for tp in range(1, devices + 1) for r in range(1, (devices // tp if ring else 1) + 1)
            for u in range(1, devices // (tp * r) + 1) if devices % (tp * r * u) == 0]


def search(traced, model_name: str, devices: int, profile: cost.DeviceProfile | None = None,
           device_memory: int | None = None, ring: bool = True, exhaustive: bool = False,
           workers: int | None = None) -> list[LayoutEstimate]:
    """Every layout on ``devices``, possible ones first, those that fit first, fastest first, from one trace
    (``trace(model, inputs)``).

    Unless ``exhaustive`` (every layout partitioned whole), two savings that leave the best layout the same:
    - a layout is costed from the trace cut to two and to three blocks of its longest chain of repeated blocks
      (``extrapolate.py``: exact for a chain of identical blocks), not from the whole trace;
    - layouts are costed by rank count, most ranks first, after the unsplit model (tp=1): no rank computes less
      than the unsplit model's compute over its rank count, so once that bound is slower than the best layout
      found that fits, the layouts of that many ranks (and of fewer) cannot be the best; they are listed as
      ``pruned`` with the bound, not costed.
    The layouts of one rank count are costed side by side in ``workers`` forked processes (default: the cores
    this process may use; one where other threads run, which a fork would not carry)."""
    profile = profile or cost.load_profile(DEFAULT_PROFILE)
    with inner_steps_quiet():
        return _search(traced, model_name, devices, profile, device_memory, ring, exhaustive, workers)


def _search(traced, model_name, devices, profile, device_memory, ring, exhaustive, workers) -> list[LayoutEstimate]:
    job = _SearchJob(None if exhaustive else _cuts(traced), traced, model_name, devices, profile, device_memory)
    unsplit = job.cost((1, 1, 1))
    found, best = [unsplit], _better(None, unsplit)
    by_ranks: dict[int, list[tuple[int, int, int]]] = {}
    for layout in layouts(devices, ring):
        if layout != (1, 1, 1):
            by_ranks.setdefault(layout[0] * layout[1] * layout[2], []).append(layout)
    with inner_steps_quiet(False):
        progress = bar(desc=f"searching layouts of {devices} devices", total=sum(map(len, by_ranks.values())),
                       unit="layout")
    for ranks in sorted(by_ranks, reverse=True):
        bound = unsplit.compute_s / ranks if not unsplit.error else 0.0
        if not exhaustive and best is not None and bound > best.step_s:
            why = (f"its compute alone, split perfectly over its {ranks} ranks, takes {bound * 1e3:.1f} ms: slower "
                   f"than {best.layout}'s {best.step_s * 1e3:.1f} ms")
            found += [LayoutEstimate(tp, u, devices // ranks, compute_s=bound, device_memory=device_memory, ring=r,
                                     profile=profile.name, pruned=why) for tp, r, u in by_ranks[ranks]]
            progress.update(len(by_ranks[ranks]))
            continue
        for estimated in _map(job.cost, by_ranks[ranks], workers):
            found.append(estimated)
            best = _better(best, estimated)
            progress.update()
    progress.close()
    return sorted(found, key=lambda e: (e.error is not None, e.pruned is not None, e.fits is False, e.step_s))


@dataclass
class _SearchJob:
    cuts: tuple | None  # (blocks, the trace cut to KEPT blocks, to KEPT + 1), or None: the whole trace
    traced: object
    model_name: str
    devices: int
    profile: cost.DeviceProfile
    device_memory: int | None

    def cost(self, layout: tuple[int, int, int]) -> LayoutEstimate:
        """The layout's estimate; a layout the partitioner fails on (a bug: ``InvariantError``) is listed with the
        failure rather than ending the search of every other layout."""
        try:
            return self._cost(layout)
        except InvariantError as error:
            tp, r, u = layout
            return LayoutEstimate(tp, u, self.devices // (tp * r * u), device_memory=self.device_memory, ring=r,
                                  profile=self.profile.name, error=f"the partitioner failed (a bug): {error}")

    def _cost(self, layout: tuple[int, int, int]) -> LayoutEstimate:
        tp, r, u = layout
        if self.cuts is None:
            return estimate(self.traced, self.model_name, tp, u, self.devices, self.profile, self.device_memory,
                            ring=r)
        blocks, *cuts = self.cuts
        return extrapolate.extrapolated(*(estimate(cut, self.model_name, tp, u, self.devices, self.profile,
                                                   self.device_memory, ring=r) for cut in cuts), blocks)


_JOB_IN_WORKER = None  # what a forked worker costs layouts with (inherited, never pickled)


def _cost_in_worker(layout):
    return _JOB_IN_WORKER(layout)


def _map(fn, items: list, workers: int | None) -> list:
    """``[fn(item) for item in items]``, over forked processes where there are several items, cores and no other
    thread (a fork copies only the calling thread: a lock another thread holds would never be released). torch.fx's
    Interpreter makes a (disabled) tqdm bar, whose class starts a monitor thread: it is stopped first, by tqdm's
    own switch (``monitor_interval = 0``), and left off in the workers."""
    global _JOB_IN_WORKER
    import multiprocessing
    import os
    import threading

    from tqdm.std import tqdm

    workers = min(len(items), workers or len(os.sched_getaffinity(0)))
    interval = tqdm.monitor_interval
    if workers > 1 and tqdm.monitor is not None:
        tqdm.monitor_interval = 0
        tqdm.monitor.exit()
        tqdm.monitor = None
    try:
        if workers < 2 or threading.active_count() > 1:
            return [fn(item) for item in items]
        _JOB_IN_WORKER = fn
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_cost_in_worker, items, chunksize=1)
    finally:
        _JOB_IN_WORKER, tqdm.monitor_interval = None, interval


def _cuts(traced) -> tuple[int, object, object] | None:
    """(the longest chain's block count, the trace cut to its first ``KEPT`` blocks, to one more), or None where
    the chain is too short for cutting to save anything."""
    longer = extrapolate.cut_chain(traced, extrapolate.KEPT + 1)
    shorter = extrapolate.cut_chain(traced, extrapolate.KEPT) if longer is not None else None
    return None if shorter is None else (longer[1], shorter[0], longer[0])


def _better(best: LayoutEstimate | None, candidate: LayoutEstimate) -> LayoutEstimate | None:
    """The faster of two layouts among those possible and not known not to fit."""
    if candidate.error or candidate.fits is False:
        return best
    return candidate if best is None or candidate.step_s < best.step_s else best
