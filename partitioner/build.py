"""Building a partition, the steps ``partition()``, ``plan()``, shape specialisations and the torch.compile frontend
share: trace (again, specialised on values, when the host prologue needs it), run the planning passes (``decide``)
then the rank passes (``partition_traced``), check a backend's rules offline, and agree with the other ranks on the
plan before any program runs (``build_agreed``)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path

import torch

from . import backends
from .errors import DataDependentNumber, InputError, PartitionError, TraceError
from .frontend.padding import parse_buckets
from .frontend.randomness import refuse_randomness
from .frontend.trace import Traced, copy_graph_module, trace
from .frontend.value_specialization import method_as_forward
from .mesh import MeshSpec
from .partitioned import Partitioned
from .passes import PLAN, TO_RANK, run_passes
from .passes.context import Overlap, PassContext
from .passes.runner import collector_skips_what_exists
from .planning.dump import Dumper
from .planning.plan_view import write_html
from .plans import Plan
from .progress import bar
from .runtime import collectives
from .runtime.agreement import CallGuard, PartitionIdentity, agree_on_plan, plan_lines
from .runtime.program import input_names


def trace_and_partition(model: torch.nn.Module, example_inputs, partition_with, *,
                        specialize_values: bool = False) -> Partitioned:
    """``partition_with(trace(model, example_inputs))``; when the host prologue cannot take a data-dependent size
    (it sizes device ops), the model is traced again specialised on its integer and boolean inputs' values
    (``value_specialization``), if it has any and the first trace was not."""
    with collector_skips_what_exists():
        start = time.perf_counter()
        with bar(desc=f"tracing {type(model).__name__} (torch.export)", total=1, unit="trace") as progress:
            traced = trace(model, example_inputs, specialize_values=specialize_values)
            progress.update()
        traced_s = time.perf_counter() - start
        try:
            partitioned = partition_with(traced)
        except DataDependentNumber as first:
            if traced.values_specialized:
                raise
            start = time.perf_counter()
            try:
                retraced = trace(model, example_inputs, specialize_values=True)
            except TraceError as again:  # the first refusal says what the model does; the retrace only failed
                why = (str(again).strip().splitlines() or [""])[0]
                raise DataDependentNumber(f"{first}\n(traced again specialised on its inputs' values: {why})") \
                    from again
            traced_s += time.perf_counter() - start
            if not retraced.values and retraced.guards is None:  # no input whose values it reads
                raise
            partitioned = partition_with(retraced)
    if isinstance(partitioned, Partitioned):  # (plan() partitions into its decision only)
        partitioned.seconds["trace"] = traced_s
    return partitioned


def build_agreed(build, spec: MeshSpec, groups, options: dict) -> Partitioned:
    """``build()`` on every rank, then the ranks compare their plans (or learn which rank failed) before any
    program runs; the partition's calls are then guarded by the same groups."""
    partitioned, failure = None, None
    try:
        partitioned = build()
    except Exception as error:  # every rank learns that this one failed, instead of waiting for it
        failure = error
    header = [f"mesh {spec.sizes}"] + [f"{key} {value!r}" for key, value in sorted(options.items())]
    if groups is not None:  # every rank reuses the same groups, or every rank made new ones
        header.append(f"process groups generation {groups.generation}")
    lines = compared_plan_lines(partitioned, header) if partitioned is not None else None
    agree_on_plan(groups, lines, failure)
    # which partition: its number on these groups (two experts of one architecture, whose weights are loaded later,
    # plan alike) and its plan
    if groups is not None:
        groups.built += 1
    identity = PartitionIdentity(partitioned.model_name, groups.built if groups is not None else 0,
                                 hashlib.sha256("\n".join(lines).encode()).hexdigest()[:8])
    partitioned.guard = CallGuard(groups, spec.device, identity=identity)
    return partitioned


def compared_plan_lines(partitioned: Partitioned, header: list[str]) -> list[str]:
    """The plan ranks compare: the global graph with its placements and shapes, how many chunks each
    row-parallel all_reduce is issued in (a profile file that differs between hosts would make ranks issue
    different collectives) and the order each all_to_all sends its pieces in (read from the device's layout: ranks
    whose devices lay a value out differently would read each other's pieces wrong, with no error); device indices
    left out (each rank has its own GPU)."""
    device = re.compile(r"device\(type='(\w+)', index=\d+\)")
    chunks = [f"all_reduce of {path}: " + (f"{how.chunks} chunks" if how.chunks > 1 else "whole")
              for path, how in sorted(partitioned.ctx.chunked.items())]
    orders = [f"all_to_all of {node.args[0].name}: pieces in order {node.args[6]}"
              for node in partitioned.graph_module.graph.nodes if node.target is collectives.all_to_all_start]
    return [device.sub(r"device(type='\1')", line)
            for line in plan_lines(partitioned.planned_graph, header)] + chunks + orders


def check_offline(partitioned: Partitioned, backend_checks, dump_dir) -> None:
    """``backend_checks``: a backend name, or {name: its compile options} such as ``{"neuron": {"pad_sequence":
    True}}``. The graph the checks see is dumped after the passes' graphs."""
    usage = f"e.g. backend_checks='neuron' or {{'neuron': {{'pad_sequence': True}}}}; backends with offline " \
            f"checks: {backends.with_checks()}"
    if isinstance(backend_checks, str):
        backend_checks = {backend_checks: {}}
    if not (isinstance(backend_checks, dict) and len(backend_checks) == 1):
        raise InputError(f"backend_checks={backend_checks!r}: name one backend, {usage}")
    (name, options), = backend_checks.items()
    backend = backends.get(name)
    if backend.check is None or not isinstance(options, dict) or set(options) - set(backend.options):
        raise InputError(f"backend_checks={backend_checks!r}: {usage}; {name!r} takes the options "
                         f"{list(backend.options)}")
    checked = backend.check(partitioned.graph_module, partitioned.mesh, **options)
    dump = Dumper(dump_dir, partitioned.mesh.rank, len(PLAN) + len(TO_RANK) + 1, partitioned.graph_module)
    dump(f"{name}_legalize", checked, partitioned.ctx)


def partition_traced(traced: Traced, mesh: MeshSpec, model_name: str, *, plan: dict[str, str] | None = None,
                     dump_dir: str | Path | None = None, bounds: dict[str, int] | None = None,
                     buckets: dict | None = None, overlap: bool | dict | Overlap = True,
                     exchange_dtype: torch.dtype | None = None) -> Partitioned:
    """Run the passes over a trace, in place (copy ``traced`` to partition one trace for several meshes).
    ``plan``: ``_tp_plan``-style overrides, or a whole ``Plan`` to apply as it is."""
    with collector_skips_what_exists():
        ctx, gm, dump = decide(traced, mesh, model_name, plan=plan, dump_dir=dump_dir, bounds=bounds,
                               buckets=buckets, overlap=overlap)
        ctx.exchange_dtype = exchange_dtype
        planned = copy_graph_module(gm)  # the global decision, kept for backends that partition themselves (XLA)
        gm = run_passes(gm, ctx, TO_RANK, dump)
    traced.graph_module, traced.inputs = gm, ctx.inputs
    partitioned = Partitioned(model_name, traced, ctx, planned)
    partitioned._specializer = specialize
    if dump.directory:  # the plan as a picture beside the pass dumps
        write_html(partitioned, dump.directory / "plan.html")
    return partitioned


def decide(traced: Traced, mesh: MeshSpec, model_name: str, *, plan: dict[str, str] | None = None,
           dump_dir: str | Path | None = None, bounds: dict[str, int] | None = None, buckets: dict | None = None,
           overlap: bool | dict | Overlap = True) -> tuple[PassContext, torch.fx.GraphModule, Dumper]:
    """The planning passes (``PLAN``) over a trace: every decision ``partition`` takes (``partitioner.plan`` reads
    them from the context), the planned global graph, and the dumper that wrote it."""
    ctx = PassContext(mesh, list(traced.inputs), bounds=dict(bounds or {}), size_bounds=dict(traced.size_bounds),
                      buckets=parse_buckets(buckets), input_names=input_names(traced.in_spec),
                      overlap=Overlap.parse(overlap))
    refuse_randomness(traced.graph_module, model_name)
    guarded = traced.guards.inputs if traced.guards is not None else set()
    read = ({ctx.input_names[i] for i in traced.values} | guarded) & {name for name, _ in ctx.buckets}
    if read:  # the values read would include the bucket's padding: the trace would be exact for the padded call
        where = traced.value_reads[0] if traced.value_reads else traced.guards.guards[0].read
        raise PartitionError(f"{model_name} reads the values of {sorted(read)} ({where}), which "
                             "buckets pad; drop the bucket for it (each size is then traced on its own)")
    if isinstance(plan, Plan):
        plan.check_mesh(mesh.sizes)
        unknown = sorted(set(plan.sequence_seeds or {}) - set(mesh.axis_names))
        if unknown:
            raise PartitionError(f"the plan's sequence_seeds name mesh axes {unknown} that the mesh "
                                 f"{mesh.sizes} does not have; plan again for this mesh")
        decided = plan.linear_decisions()
        ctx.plan = {path: entry.style for path, entry in decided.items()}
        ctx.packed_overrides = {path: entry.blocks for path, entry in decided.items() if entry.blocks}
        ctx.unit_overrides = {path: entry.unit for path, entry in decided.items() if entry.unit > 1}
        ctx.given_sequence_seeds = None if plan.sequence_seeds is None else dict(plan.sequence_seeds)
        ctx.bounds = {**plan.bounds, **ctx.bounds}
    else:
        ctx.plan = dict(plan or {})
    dump = Dumper(dump_dir or os.environ.get("PARTITIONER_DUMP"), mesh.rank)
    gm = traced.graph_module
    dump("export", gm, ctx)
    return ctx, run_passes(gm, ctx, PLAN, dump), dump


def specialize(partitioned: Partitioned, example_inputs) -> Partitioned:
    """``Partitioned.specialize``: ``partitioned``'s skeleton traced on ``example_inputs`` with its plan applied,
    sharing its weights, process groups and guard. The plan's sequence seeds are derived again where the new trace
    has no value for one of their keys (the Linears' plan is kept)."""
    plan, skeleton = Plan.of(partitioned), partitioned.skeleton
    options = dict(mesh=partitioned.mesh, model_name=partitioned.model_name, bounds=partitioned.ctx.bounds,
                   buckets=partitioned.ctx.buckets, overlap=partitioned.ctx.overlap,
                   exchange_dtype=partitioned.ctx.exchange_dtype)

    def partition_with(traced: Traced) -> Partitioned:
        try:
            return partition_traced(traced, plan=plan, **options)
        except DataDependentNumber:
            raise
        except PartitionError as error:
            traced = trace(skeleton, example_inputs, specialize_values=traced.values_specialized)
            new = partition_traced(traced, plan=dataclasses.replace(plan, sequence_seeds=None), **options)
            new.ctx.replanned = f"sequence seeds derived again: {str(error)[:200]}"
            return new

    def build() -> Partitioned:
        # traced for its inputs' values: so is every specialisation
        new = trace_and_partition(skeleton, example_inputs, partition_with,
                                  specialize_values=partitioned.traced.values_specialized)
        if new.slice_specs != partitioned.slice_specs:
            raise PartitionError(f"{partitioned.model_name}: these input shapes would cut the weights differently "
                                 "than the traced ones; partition again for them")
        # The weights are shared. The new trace's own constants (what it folded from the values it was traced
        # for, tensors the model makes from literals) replace those of the same name.
        new.state = {**partitioned.state, **_real_constants(new, new.state, partitioned.state)}
        if partitioned.global_state is not None:
            new.global_state = {**partitioned.global_state,
                                **_real_constants(new, new.global_state, partitioned.global_state)}
        for name in ("checkpoint", "model_config", "model_dtype", "skeleton", "source", "trainable",
                     "traced_training", "traced_autocast"):
            setattr(new, name, getattr(partitioned, name))
        return new

    with method_as_forward(skeleton, partitioned.method):
        specialized = build_agreed(build, partitioned.mesh, partitioned.guard.groups,
                                   {"specialize": partitioned.model_name})
    specialized.method = partitioned.method
    specialized.guard = partitioned.guard  # one partition: a failure in any specialisation stops them all
    return specialized


def _real_constants(partitioned: Partitioned, state: dict, like: dict) -> dict[str, torch.Tensor]:
    """The constants of ``partitioned``'s trace that have values (a skeleton on the meta device traces meta ones),
    on the device of the tensors in ``like``."""
    device = next((t.device for t in like.values() if not t.is_meta), None)
    return {gi.target: state[gi.target].to(device) if device is not None else state[gi.target]
            for gi in partitioned.ctx.inputs if gi.kind == "constant" and gi.target in state
            and not state[gi.target].is_meta}
