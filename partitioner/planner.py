"""Deployment planning on meta weights: what one rank holds and moves under a (tp, ring, ulysses) layout, whether
it fits a device, and a search over layouts ranked by an estimated step time. No weight is ever allocated.

The step-time model, stated so it can be argued with:

    step = flops / peak_flops  +  sum over collectives of (bytes x algorithm factor) / link_bandwidth

- ``flops``: this rank's matmul and attention work, read off its partitioned graph (linear: 2 x rows x in x out;
  attention: 4 x heads x query rows x key rows x head_dim; a ring attention's key rows are the whole ring's).
  Elementwise ops and memory traffic are ignored.
- collective bytes per call are the result bytes on this rank; ring factors: all_reduce 2(n-1)/n,
  all_gather and all_to_all (n-1)/n, for a group of n ranks; a ring attention's pass sends its key/value block
  once to the next rank (factor 1, counted ring - 1 times per attention).
- compute and communication do not overlap (pessimistic), and there is no per-collective latency term.
Defaults describe one Trainium2 logical core (``--tflops 80``, ``--link-gbps 100``); set them for your hardware.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .api import partition_traced
from .mesh import as_mesh_spec
from .errors import InputError, PartitionError
from .trace import trace

aten = torch.ops.aten
MODELS = {"minimax-h3": "MiniMaxH3Transformer3DModel"}
_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
            "all_to_all": lambda n: (n - 1) / n, "ring_pass": lambda n: 1.0}


@dataclass(frozen=True)
class CostModel:
    tflops: float = 80.0  # dense bf16 peak per device, TFLOP/s
    link_gbps: float = 100.0  # collective bandwidth per device, GB/s


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
    comm_s: float = 0.0
    device_memory: int | None = None
    error: str | None = None  # why this layout is impossible
    ring: int = 1

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
        return self.compute_s + self.comm_s

    @property
    def requests_per_s(self) -> float:
        """Throughput of all replicas together (the search ranks by step time, i.e. latency)."""
        return self.replicas / self.step_s if self.step_s else 0.0

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory_bytes <= self.device_memory

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "memory_bytes": self.memory_bytes, "step_s": self.step_s,
                "requests_per_s": self.requests_per_s, "fits": self.fits}


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
    from .testing import h3_inputs

    if type(model).__name__ != "MiniMaxH3Transformer3DModel":
        raise InputError(f"no input layout is known for {type(model).__name__}; use the Python API with your own "
                         "example_inputs")
    text = min(512, seq_len // 4)
    audio = max(1, seq_len // 74)
    inputs = h3_inputs(dict(model.config), text=text, video=seq_len - text - audio, audio=audio, device="meta")
    return ((), {k: v.to(dtype) if v.is_floating_point() and k != "timestep" else v for k, v in inputs.items()})


def graph_flops(gm: torch.fx.GraphModule) -> float:
    from .collectives import ring_attention

    flops = 0.0
    for node in gm.graph.nodes:
        if node.target is aten.linear.default:
            flops += 2 * node.meta["val"].numel() * node.args[1].meta["val"].shape[1]
        elif node.target in (aten.scaled_dot_product_attention.default, ring_attention):
            q, k = node.args[0].meta["val"], node.args[1].meta["val"]
            keys = sum(node.args[4]) if node.target is ring_attention else k.shape[-2]  # every block of the ring
            flops += 4 * q.shape[:-2].numel() * q.shape[-2] * keys * q.shape[-1]
    return flops


def estimate(traced, model_name: str, tp: int, ulysses: int, devices: int | None = None,
             cost: CostModel = CostModel(), device_memory: int | None = None, ring: int = 1) -> LayoutEstimate:
    """Partition a copy of ``traced`` for rank 0 (the largest share where splits are uneven) and cost it."""
    ranks = tp * ring * ulysses
    result = LayoutEstimate(tp, ulysses, (devices or ranks) // ranks, device_memory=device_memory, ring=ring)
    mesh = as_mesh_spec({"tp": tp, "ring": ring, "ulysses": ulysses}, rank=0)
    try:
        partitioned = partition_traced(dataclasses.replace(traced, graph_module=copy.deepcopy(traced.graph_module)),
                                       mesh, model_name)
    except PartitionError as error:
        result.error = str(error)
        return result
    report = partitioned.report()
    result.parameter_bytes = report.parameter_bytes
    result.parameter_count = report.parameters
    result.parameter_ranks = report.parameter_extremes()
    result.activation_bytes = report.activation_peak_bytes
    for c in report.collectives:
        result.collective_bytes[c.kind] = result.collective_bytes.get(c.kind, 0) + c.count * c.bytes_per_call
        result.comm_s += c.count * c.bytes_per_call * _FACTORS[c.kind](mesh.size(c.axis)) / (cost.link_gbps * 1e9)
    result.flops = graph_flops(partitioned.graph_module)
    result.compute_s = result.flops / (cost.tflops * 1e12)
    return result


def layouts(devices: int, ring: bool = True) -> list[tuple[int, int, int]]:
    """Every (tp, ring, ulysses) whose product divides ``devices`` (the rest are replicas); ring 1 only when
    ``ring`` is false."""
    return [(tp, r, u) for tp in range(1, devices + 1) for r in range(1, (devices // tp if ring else 1) + 1)
            for u in range(1, devices // (tp * r) + 1) if devices % (tp * r * u) == 0]


def search(model: torch.nn.Module, inputs, devices: int, cost: CostModel = CostModel(),
           device_memory: int | None = None, ring: bool = True) -> list[LayoutEstimate]:
    """Every layout on ``devices``, possible ones first, those that fit first, fastest first. One trace serves
    all of them."""
    traced = trace(model, inputs)
    found = [estimate(traced, type(model).__name__, tp, u, devices, cost, device_memory, ring=r)
             for tp, r, u in layouts(devices, ring)]
    return sorted(found, key=lambda e: (e.error is not None, e.fits is False, e.step_s))
