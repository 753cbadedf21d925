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
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api import partition_traced
from ..errors import InputError, PartitionError
from ..frontend.trace import copy_graph_module
from ..mesh import as_mesh_spec
from ..passes.context import Overlap
from . import cost

MODELS = {"minimax-h3": "MiniMaxH3Transformer3DModel"}
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


def apply_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast to ``dtype`` except what the model keeps in float32 (diffusers' ``_keep_in_fp32_modules``, matched as
    substrings of tensor names, as diffusers does), e.g. H3's patch projections, timestep MLP and output heads."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if any(p in name for p in keep) else dtype)
    return model


def build_meta_model(model: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model by name (``minimax-h3``: the full 33B configuration) or from a diffusers config.json (or the folder
    holding it), on the meta device (``partition`` computes the non-persistent buffers it needs)."""
    import diffusers

    if model in MODELS:
        cls, config = getattr(diffusers, MODELS[model]), None
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise InputError(f"{model!r} is neither a known model ({sorted(MODELS)}) nor a config file")
        config = json.loads(path.read_text())
        cls = getattr(diffusers, config.get("_class_name", ""), None)
        if cls is None:
            raise InputError(f"{path}: '_class_name' {config.get('_class_name')!r} is not a diffusers model class")
    with torch.device("meta"):
        built = cls() if config is None else cls.from_config(config)
    return apply_dtype(built.eval(), dtype)


def example_inputs(model: torch.nn.Module, seq_len: int, dtype: torch.dtype = torch.bfloat16):
    """Meta inputs of one packed request of ``seq_len`` rows. For MiniMax-H3: 512 text rows (fewer for short
    sequences), 1/74 of the rows audio, the rest video, two distinct timesteps."""
    from ..testing import h3_inputs

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
    mesh = as_mesh_spec({"tp": tp, "ring": ring, "ulysses": ulysses}, rank=0, programs="rank")
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
           device_memory: int | None = None, ring: bool = True) -> list[LayoutEstimate]:
    """Every layout on ``devices``, possible ones first, those that fit first, fastest first, from one trace
    (``trace(model, inputs)``)."""
    profile = profile or cost.load_profile(DEFAULT_PROFILE)
    found = [estimate(traced, model_name, tp, u, devices, profile, device_memory, ring=r)
             for tp, r, u in layouts(devices, ring)]
    return sorted(found, key=lambda e: (e.error is not None, e.fits is False, e.step_s))
