"""What every pass reads and writes besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decisions import AttentionSequencing, BatchSplit, Chunking, LinearSharding, SequenceSeed
from ..errors import InvariantError
from ..frontend.trace import GraphInput
from ..mesh import MeshSpec


@dataclass(frozen=True)
class Overlap:
    """Which communication/computation overlap techniques a rank's graph gets (``partition(..., overlap=)``):
    ``chunk_reductions`` splits a row-parallel linear so its all_reduce overlaps its own matmul, ``schedule``
    issues collectives early and waits late with independent compute in between, ``tp_sequence`` shards the rows
    over tp between the tensor-parallel regions instead of repeating them on every rank. ``profile``: the device
    profile (``partitioner/planning/profiles``) whose costs decide all three; None picks it from the mesh's device type."""
    chunk_reductions: bool = True
    schedule: bool = True
    profile: object = None  # a profile name, JSON path or DeviceProfile
    tp_sequence: bool = True

    @classmethod
    def parse(cls, value) -> "Overlap":
        if isinstance(value, Overlap):
            return value
        if isinstance(value, bool):
            return cls(chunk_reductions=value, schedule=value, tp_sequence=value)
        fields = ("chunk_reductions", "schedule", "profile", "tp_sequence")
        if isinstance(value, dict) and set(value) <= set(fields):
            return cls(**value)
        from ..errors import InputError

        raise InputError(f"overlap={value!r}: use True, False or a dict with keys from {list(fields)}, e.g. "
                         "{'chunk_reductions': False}")

    def profile_for(self, device_type: str):
        return self.profile or {"cpu": "cpu-gloo", "cuda": "h100-nvlink"}.get(device_type, "trn2")


@dataclass
class PassContext:
    mesh: MeshSpec
    inputs: list[GraphInput]  # what each placeholder of the graph is, in placeholder order
    plan: dict[str, str] = field(default_factory=dict)  # user overrides, diffusers `_tp_plan` key syntax
    packed_overrides: dict[str, tuple[int, ...]] = field(default_factory=dict)  # path -> packed blocks (a Plan)
    unit_overrides: dict[str, int] = field(default_factory=dict)  # path -> the unit a column shard splits in (a Plan)
    given_sequence_seeds: dict[str, tuple] | None = None  # a Plan's SequenceSeeds per axis, applied as they are
    bounds: dict[str, int] = field(default_factory=dict)  # data-dependent op name -> size bound (user option)
    size_bounds: dict[str, int] = field(default_factory=dict)  # symbol -> bound, from torch._check in the trace
    buckets: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)  # (input, dim) -> sizes (user)
    input_names: list[str] = field(default_factory=list)  # the flattened forward arguments' names
    overlap: Overlap = field(default_factory=Overlap)  # communication/computation overlap techniques (user option)
    exchange_dtype: torch.dtype | None = None  # all_to_all pieces travel in it (user option, runtime/low_precision)
    # Filled by the passes:
    linear_styles: dict[str, LinearSharding] = field(default_factory=dict)  # module path -> its decision
    replicated_because: dict[str, str] = field(default_factory=dict)  # module path -> why not column-sharded
    # quantised parameters (a tensor subclass's parts) no Linear reads, held whole on every tp rank -> what reads them
    whole_quantised: dict[str, str] = field(default_factory=dict)
    slice_specs: dict[str, dict] = field(default_factory=dict)  # tensor FQN -> {axis: placement} (localize)
    attention: list = field(default_factory=list)  # HeadInfo per attention (annotate_heads)
    sequence_stopped: dict[str, str] = field(default_factory=dict)  # value -> why it was not sequence-sharded
    sequence_sharded_at: list[str] = field(default_factory=list)  # values sliced to start sequence parallelism
    sequence_attention: dict[str, AttentionSequencing] = field(default_factory=dict)  # attention module -> decision
    sequence_whole: dict[str, str] = field(default_factory=dict)  # attention module left whole -> the first reason
    sequence_idle: list[str] = field(default_factory=list)  # sequence axes (of size > 1) that split no value
    sequence_seeds: dict[str, tuple[SequenceSeed, ...]] = field(default_factory=dict)  # axis -> where it starts
    batch_split: dict[str, BatchSplit] = field(default_factory=dict)  # input -> split along the batch, or why not
    padding_reads: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # node indexing a padded dim ->
    #   (flat argument index, dim, padded size) of the input it picks from (pad_inputs)
    chunked: dict[str, Chunking] = field(default_factory=dict)  # row-parallel linear -> its all_reduce's chunks
    tp_sequence: str = ""  # whether rows are sharded over tp between the tp regions, and why (plan_tp_sequence)
    reduce_scattered: dict[str, str] = field(default_factory=dict)  # row-parallel linear -> rows its sum scatters
    collective_order: list[str] = field(default_factory=list)  # collectives in issue order (schedule_collectives)
    host: object = None  # HostProgram (hoist_host): the CPU prologue, when the model has data-dependent ops
    pass_seconds: dict[str, float] = field(default_factory=dict)  # pass name -> time it took (the runner)
    specializations: dict[str, str] = field(default_factory=dict)  # call shapes served by another trace -> why
    replanned: str = ""  # why a specialisation could not take the whole plan (its sequence seeds), if so

    def placeholder_inputs(self, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, GraphInput]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.inputs):
            raise InvariantError(f"graph has {len(placeholders)} placeholders, signature {len(self.inputs)}")
        return dict(zip(placeholders, self.inputs))
