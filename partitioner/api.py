"""The user API: ``partition(model, mesh, example_inputs)`` and ``plan(...)``: trace, decide (the planning
passes), agree across ranks, and build this rank's program (``Partitioned``)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import weakref
from pathlib import Path

import torch

from .errors import InputError, TraceError
from .frontend.padding import pad_named, parse_buckets
from .frontend.trace import Traced, bind_forward
from .frontend.value_specialization import method_as_forward
from .mesh import as_mesh_spec
from .build import build_agreed, check_offline, decide, partition_traced, trace_and_partition
from .partitioned import Partitioned
from .passes.context import Overlap
from .passes.plan_sequence import warn_whole_attentions
from .passes.plan_sharding import warn_unsplit_linears
from .plans import Plan
from .runtime.rank_groups import DEFAULT_TIMEOUT, bounded_groups
from .runtime.fingerprints import check_fingerprint, weights_digest
from .runtime.low_precision import check_exchange_dtype
from .tensor_parts import is_wrapped
from .runtime.gradients import marked_to_train


def _compute_meta_buffers(model: torch.nn.Module, traced: Traced) -> None:
    """Non-persistent buffers of a model built on the meta device (``rope.inv_freq``) are in no checkpoint: compute
    them by rebuilding a diffusers model from its config with parameters on meta and buffers real (accelerate's
    ``init_empty_weights``), which costs no weight memory."""
    names = [gi.target for gi in traced.inputs if gi.kind == "buffer" and not gi.persistent
             and traced.state[gi.target].is_meta]
    if not names or not (hasattr(model, "config") and hasattr(type(model), "from_config")):
        return
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        fresh = type(model).from_config(model.config)
    buffers = dict(fresh.named_buffers())
    for name in names:
        traced.state[name] = buffers[name]


def partition(model: torch.nn.Module, mesh, example_inputs, *, plan: dict[str, str] | Plan | None = None,
              dump_dir: str | Path | None = None, rank: int = 0, bounds: dict[str, int] | None = None,
              backend_checks: str | dict | None = None, buckets: dict | None = None,
              timeout: float = DEFAULT_TIMEOUT, overlap: bool | dict = True,
              input_fingerprint: str = "sample", method: str = "forward", programs: str = "rank",
              cfg: str = "batch", exchange_dtype: torch.dtype | None = None) -> Partitioned:
    """Trace ``model`` on ``example_inputs = (args, kwargs)`` and rewrite it into this rank's program.

    ``mesh``: a DeviceMesh with dim names from {"tp", "ring", "ulysses", "dp" (or "cfg")}, or axis sizes such as
    ``{"tp": 8}`` to plan without process groups (then ``rank`` picks which rank's program to build: the program
    rank ``rank`` of a mesh of those sizes runs). ``programs="global"`` (axis sizes only) plans XLA SPMD's one
    program instead, for ``compile(backend="xla")``; XLA tiles equally, so some values stay whole there that rank
    programs split. ``plan``: overrides in diffusers'
    ``_tp_plan`` key syntax, e.g. ``{"transformer_blocks.*.attn.to_q": "colwise"}``, or a whole ``Plan`` (from
    ``partitioner.plan``, possibly edited) applied as it is. ``dump_dir`` (or
    ``$PARTITIONER_DUMP``): write the graph after every pass. ``bounds``: upper bounds of data-dependent sizes
    for code that has no ``torch._check``, keyed by the op's node name (e.g. ``{"_unique2": 4}``). ``buckets``:
    input dims padded with zeros to the next of a few sizes, so that one partition serves every size up to them,
    e.g. ``{"timestep": [2, 4]}`` (dim 0; ``{("name", dim): sizes}`` for another dim). The trace is padded to the
    bucket of the example's size; each other bucket is a shape specialisation of ``compile()``'s module. A dim is
    bucketed only where the padding is provably never read (a table indexed by per-row indices, as a timestep
    table is); otherwise a ``PartitionError`` names the op that would read it.
    ``backend_checks="neuron"``: check this rank's graph against Neuron's rules now, on any machine (a
    ``NeuronLegalityError`` lists every problem with its fix); ``{"neuron": {"pad_sequence": True}}`` checks it as
    ``compile(backend="neuron", pad_sequence=True)`` will build it. ``overlap``: hide communication behind
    computation (row-parallel all_reduces in chunks, collectives issued early and waited on late, each where the
    cost model says it pays); ``False`` turns it off, ``{"chunk_reductions": False}`` or ``{"schedule": False}``
    one technique, ``{"profile": "h100-nvlink"}`` picks the device profile the costs come from.

    On a DeviceMesh every rank must call ``partition`` (it creates the partition's process groups, whose every
    collective is bounded by ``timeout`` seconds) and the ranks compare their plans: a rank that built another plan
    or failed to build one raises ``RankDisagreement`` on every rank. ``input_fingerprint``: how each call's input
    values are compared between ranks: "sample" (default: a float64 weighted sum over a fixed sample of 4096 elements
    of each input tensor), "full" (a hash of every byte) or "off"; ranks called with other values raise
    ``InputError`` on every rank naming the inputs (``Partitioned.input_fingerprint`` changes it later).
    ``method``: the model's method traced as the entry, "forward" by default; a VAE's "decode" or "encode" (then
    ``example_inputs`` and every call are that method's arguments). Over a ring axis a convolutional network's
    rows are split along height (``docs/vae.md``). ``cfg``: what a "cfg" mesh axis divides: "batch" (default:
    each call's batch, both guidance branches in one call, as "dp") or "pairs" (the program is replicated over
    it; ``parallelize`` runs a pipeline's two guidance calls of a step at once on its halves, see
    ``docs/pipelines.md``). ``exchange_dtype`` (opt-in, inference only): the all_to_all pieces of sequence
    parallelism travel in ``torch.float8_e4m3fn`` / ``float8_e5m2`` with a float32 scale per row, or in
    ``torch.bfloat16``, and are restored on arrival: fewer bytes for a measured error (``docs/quantized.md``);
    sums always travel in the values' own dtype.
    """
    start = time.perf_counter()
    check_fingerprint(input_fingerprint)
    check_exchange_dtype(exchange_dtype, model)
    spec, groups = mesh_with_groups(mesh, rank, timeout, programs)
    spec = dataclasses.replace(spec, cfg=cfg)
    buckets = parse_buckets(buckets)

    def partition_with(traced: Traced) -> Partitioned:
        _compute_meta_buffers(model, traced)
        return partition_traced(traced, spec, type(model).__name__, plan=plan, dump_dir=dump_dir,
                                bounds=bounds, buckets=buckets, overlap=overlap, exchange_dtype=exchange_dtype)

    def build() -> Partitioned:
        partitioned = trace_bucketed(model, example_inputs, buckets, partition_with)
        if backend_checks is not None:
            check_offline(partitioned, backend_checks, dump_dir or os.environ.get("PARTITIONER_DUMP"))
        return partitioned

    overlap = Overlap.parse(overlap)
    options = dict(plan=plan, bounds=bounds, backend_checks=backend_checks, buckets=buckets, overlap=overlap,
                   input_fingerprint=input_fingerprint, method=method, programs=programs, cfg=cfg,
                   exchange_dtype=exchange_dtype)
    if groups is not None:  # ranks whose models hold other weights refuse together (sampled: cheap)
        options["model weights (sampled; every rank must build or load the same)"] = weights_digest(model)
    with method_as_forward(model, method):
        partitioned = build_agreed(build, spec, groups, options)
    partitioned.method = method
    partitioned.guard.fingerprint = input_fingerprint
    warn_whole_attentions(partitioned.ctx)
    warn_unsplit_linears(partitioned.ctx)
    partitioned.source = weakref.ref(model)
    # (torchao freezes the weights it quantises and leaves biases as they were: that marks nothing to train)
    requires_grad = [p.requires_grad for p in model.parameters() if not is_wrapped(p)]
    partitioned.trainable = marked_to_train(requires_grad, model.training)
    if partitioned.trainable and not all(requires_grad):  # an optimizer steps this rank's shards of them (compile()'s
        partitioned.train_weights(name for name, p in model.named_parameters() if p.requires_grad)  # parameters)
    partitioned.traced_training = model.training
    partitioned.skeleton = _skeleton(model)
    partitioned.model_config = getattr(model, "config", None)
    partitioned.model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    partitioned.seconds["partition"] = time.perf_counter() - start
    return partitioned


def trace_bucketed(model: torch.nn.Module, example_inputs, buckets: dict, partition_with):
    """``trace_and_partition`` on the example inputs padded to their ``buckets`` (parsed)."""
    try:
        return trace_and_partition(model, _padded_to_buckets(model, example_inputs, buckets), partition_with)
    except TraceError as error:
        if not buckets:
            raise
        padded = ", ".join(f"{name} dim {dim} to {list(sizes)}" for (name, dim), sizes in buckets.items())
        raise TraceError(f"{error}\n(the example inputs were padded to buckets: {padded}; the model may not take a "
                         "padded size there)") from error


def _padded_to_buckets(model: torch.nn.Module, example_inputs, buckets) -> tuple:
    """The example inputs with every bucketed dim padded to its bucket, as ``((), {name: value})``."""
    if not buckets or not (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
                           and isinstance(example_inputs[1], dict)):
        return example_inputs  # (trace says what is wrong with malformed ones)
    args, kwargs = example_inputs
    owner = type(model).__name__
    named = bind_forward(inspect.signature(model.forward), tuple(args), kwargs, owner, InputError)
    return (), pad_named(named, buckets, owner)


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """The model without weights, to trace again for other input shapes: a diffusers model rebuilt from its config
    on the meta device; any other model, or a quantised one, is kept as it is (its weights stay referenced)."""
    if all(p.is_meta for p in model.parameters()) or any(is_wrapped(p) for p in model.parameters()):
        return model  # (a quantised model's config rebuilds a float one)
    if hasattr(model, "config") and hasattr(type(model), "from_config"):
        with torch.device("meta"):
            skeleton = type(model).from_config(model.config)
        originals = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]:
            if name in originals and tensor.dtype != originals[name].dtype:  # mixed precision, as the model has it
                tensor.data = tensor.data.to(originals[name].dtype)
        return skeleton.train(model.training)
    return model


def mesh_with_groups(mesh, rank: int, timeout: float, programs: str = "rank"):
    """The mesh spec, and for a DeviceMesh the partition's own process groups (collectives bounded by ``timeout``),
    which the spec's group names then point at."""
    spec = as_mesh_spec(mesh, rank, programs)
    groups = bounded_groups(spec.axis_names, spec.axis_sizes, timeout, spec.runnable)
    if groups is not None:
        spec = dataclasses.replace(spec, group_names=groups.axes)
    return spec, groups


def plan(model, mesh, example_inputs, *, plan: dict[str, str] | None = None, bounds: dict[str, int] | None = None,
         buckets: dict | None = None, overlap: bool | dict = True, rank: int = 0, dump_dir=None,
         method: str = "forward", programs: str = "rank", cfg: str = "batch") -> Plan:
    """The decisions ``partition(model, mesh, example_inputs, ...)`` takes, as a ``Plan``: the same trace and
    planning passes, stopped before this rank's program is built. A DeviceMesh (real or PyTorch's fake process
    group) and axis sizes alike plan the rank programs a mesh of those sizes runs; ``programs="global"`` (axis
    sizes) XLA's global program, exactly as ``partition`` does. No process group is used or created, nothing is
    compared between ranks, and no weights are needed (a meta model plans as well)."""
    ctx = planned(model, mesh, example_inputs, plan=plan, bounds=bounds, buckets=buckets, overlap=overlap, rank=rank,
                  dump_dir=dump_dir, method=method, programs=programs, cfg=cfg)
    warn_whole_attentions(ctx)
    warn_unsplit_linears(ctx)
    return Plan.of(ctx)


def planned(model, mesh, example_inputs, *, plan=None, bounds=None, buckets=None, overlap=True, rank=0,
            dump_dir=None, method="forward", programs="rank", cfg="batch"):
    """The planning passes' context for ``plan(...)``'s arguments: the typed decisions ``Plan`` records, and what
    it leaves out (``planning.coverage`` reads which attentions and Linears are split, and why not)."""
    spec, buckets = dataclasses.replace(as_mesh_spec(mesh, rank, programs), cfg=cfg), parse_buckets(buckets)
    with method_as_forward(model, method):
        return trace_bucketed(model, example_inputs, buckets, lambda traced: decide(
            traced, spec, type(model).__name__, plan=plan, dump_dir=dump_dir, bounds=bounds, buckets=buckets,
            overlap=overlap)[0])
