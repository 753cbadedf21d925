"""``Partitioned``: what ``partition`` returns: this rank's program and shards, the global plan, and what can be
asked of them (explain, report, verify, compile, load_weights, specialize)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
import weakref
from collections import Counter
from pathlib import Path

import torch

from . import backends
from .errors import (BackendError, CheckpointError, DataDependentNumber, InputError, MissingWeights, NotFound,
                     PartitionError, VerificationError, did_you_mean, our_step)
from .frontend.padding import parse_buckets
from .frontend.randomness import refuse_randomness
from .frontend.trace import Traced, copy_graph_module, trace
from .frontend.value_specialization import method_as_forward
from .mesh import MeshSpec
from .passes import PLAN, TO_RANK, run_passes
from .passes.context import Overlap, PassContext
from .passes.runner import collector_skips_what_exists
from .planning.dump import Dumper
from .planning.plan_view import write_html
from .planning.report import Report, build_report, collective_stats
from .plans import Plan
from .progress import bar
from .runtime.agreement import CallGuard, PartitionIdentity, agree_on_plan, agree_on_staging, plan_lines
from .runtime import collectives
from .runtime.checkpoint import load_shards
from .runtime.fingerprints import check_fingerprint
from .runtime.program import autocast_dtype, input_names, place_graph_on
from .runtime.weights import shard_state


class Partitioned:
    """One rank's partition of a model: its graph, its weight shards, and how both were derived."""

    def __init__(self, model_name: str, traced: Traced, ctx: PassContext, planned: torch.fx.GraphModule):
        self.model_name = model_name
        self.traced = traced
        self.ctx = ctx
        self.graph_module = traced.graph_module  # this rank's program
        self.planned_graph = planned  # the global graph with every value's placements (what XLA SPMD takes)
        tensor_names = [gi.target for gi in ctx.inputs if gi.is_model_tensor]
        self.state = shard_state(traced.state, tensor_names, ctx.slice_specs, ctx.mesh)
        # A mesh given as axis sizes is driven by one process (XLA SPMD): it keeps the model's full tensors. A
        # DeviceMesh rank keeps only its shards, so the model can be freed.
        self.global_state = traced.state if not ctx.mesh.runnable else None
        self.checkpoint = None  # (path, strict) of the last load_weights
        self.guard = CallGuard(None, ctx.mesh.device)  # replaced by partition() on process groups
        self.trainable = False  # the model had weights that require grad (partition() sets it)
        self.traced_training = False  # the model's mode when traced: a call in the other mode is refused
        self.traced_autocast = autocast_dtype(ctx.mesh.device_type)  # the autocast it was traced under (or None)
        self.source = None  # weak reference to the model, for verify()
        self.skeleton = None  # the model on the meta device, traced again for other call shapes (specialize)
        self.method = "forward"  # the model's method traced as the entry (a VAE's "decode")
        self.model_config, self.model_dtype = None, None  # what pipelines read from the model
        self._whole = None  # whole tensors for XLA, read again after load_weights
        self._children: list = []  # weak references to shape specialisations, which load_weights updates too
        # what making it cost, on the way to its first step: trace, passes, partition, load_weights, compile
        # (and "first call", which the drop-in module adds and logs: ``runtime.module.first_step_line``)
        self.seconds: dict[str, float] = {"passes": sum(ctx.pass_seconds.values())}
        traced.state = {}

    def load_weights(self, path, *, device=None, strict: bool = True) -> "Partitioned":
        """Replace this rank's tensors by its slices of a safetensors checkpoint (a file, an index file or a
        diffusers model folder), keeping the checkpoint's dtypes, on ``device`` (default: the mesh's device).
        Non-persistent buffers (e.g. ``rope.inv_freq``) are not in checkpoints: they keep their computed values.
        Nothing is replaced unless every tensor was found and read. ``compile(backend="xla")``, which drives every
        device from one process, reads the whole tensors from the same checkpoint when it runs.
        On a DeviceMesh every rank must call it: each rank reads and checks its shards into staging, the ranks
        agree, and every rank commits them or none does (a failure on any rank is a ``CheckpointError`` on every
        rank naming the rank and the file; the partition keeps its previous weights)."""
        self.guard.check_usable()
        staged, failure, start = None, None, time.perf_counter()
        try:
            expected, computed = self._checkpoint_tensors()
            shards = load_shards(path, expected, self.slice_specs, self.mesh, strict=strict)
            device = torch.device(device) if device is not None else self.mesh.device
            shards.update({name: self.state[name] for name in computed})
            staged = {name: tensor.to(device) for name, tensor in shards.items()}
        except Exception as error:  # every rank learns it, and none commits
            failure = error if isinstance(error, CheckpointError) else \
                CheckpointError(f"{path}: loading failed: {type(error).__name__}: {error}")
        with self.guard.exclusive():  # (its exchange shares the mesh's groups with every call)
            agree_on_staging(self.guard, failure, f"load_weights({str(path)!r})")
        for name, weight in self.state.items():  # weights in training keep their identity (an optimizer holds them)
            if isinstance(weight, torch.nn.Parameter) and name in staged:
                weight.data = staged[name].to(weight.dtype)
                staged[name] = weight
        self.state = staged
        self.checkpoint = (path, strict)
        for child in [ref() for ref in self._children]:  # shape specialisations share the weights
            if child is not None:
                child.state = {**child.state, **{n: staged[n] for n in expected if n in child.state}}
                child.checkpoint, child._whole = self.checkpoint, None
        self._whole = None
        self.seconds["load_weights"] = time.perf_counter() - start
        return self

    def specialize(self, example_inputs) -> "Partitioned":
        """This partition for other input shapes: the skeleton traced on ``example_inputs`` and this partition's
        plan applied (its sequence seeds re-derived if the new trace names values differently), sharing this rank's
        weights, its process groups and its guard. Every rank must call it with inputs of the same shapes (inputs
        with ``buckets`` padded to a bucket already)."""
        if self.skeleton is None:
            raise InputError(f"{self.model_name}: this partition serves only the traced shapes (it was not made by "
                             "partition() from a module); partition again for other shapes")
        plan = Plan.of(self)

        def partition_with(traced: Traced) -> Partitioned:
            try:
                return partition_traced(traced, self.mesh, self.model_name, plan=plan, bounds=self.ctx.bounds,
                                        buckets=self.ctx.buckets, overlap=self.ctx.overlap)
            except DataDependentNumber:
                raise
            except PartitionError as error:  # the new trace's values have other names: keep the Linears' plan
                traced = trace(self.skeleton, example_inputs, specialize_values=traced.values_specialized)
                new = partition_traced(traced, self.mesh, self.model_name, bounds=self.ctx.bounds,
                                       buckets=self.ctx.buckets, overlap=self.ctx.overlap,
                                       plan=dataclasses.replace(plan, sequence_seeds=None, sequence_seeds_by_axis=None))
                new.ctx.replanned = f"sequence seeds derived again: {str(error)[:200]}"
                return new

        def build() -> Partitioned:
            # traced for its inputs' values: so is every specialisation
            new = trace_and_partition(self.skeleton, example_inputs, partition_with,
                                      specialize_values=self.traced.values_specialized)
            if new.slice_specs != self.slice_specs:
                raise PartitionError(f"{self.model_name}: these input shapes would cut the weights differently than "
                                     "the traced ones; partition again for them")
            # The weights are shared. The new trace's own constants (what it folded from the values it was traced
            # for, tensors the model makes from literals) replace those of the same name.
            new.state = {**self.state, **_real_constants(new, new.state, self.state)}
            if self.global_state is not None:
                new.global_state = {**self.global_state, **_real_constants(new, new.global_state, self.global_state)}
            new.checkpoint = self.checkpoint
            new.model_config, new.model_dtype, new.skeleton, new.source = \
                self.model_config, self.model_dtype, self.skeleton, self.source
            new.trainable, new.traced_training, new.traced_autocast = \
                self.trainable, self.traced_training, self.traced_autocast
            return new

        with method_as_forward(self.skeleton, self.method):
            specialized = build_agreed(build, self.mesh, self.guard.groups, {"specialize": self.model_name})
        specialized.method = self.method
        specialized.guard = self.guard  # one partition: a failure in any specialisation stops them all
        self._children.append(weakref.ref(specialized))
        return specialized

    def train_weights(self, names) -> None:
        """This rank's tensors of the weights ``names`` (those the model marks to train) as parameters, sharded as the
        weights are, copies (an optimizer stepping them must not write into the model's own weights)."""
        for name in set(names) & self.state.keys():
            if not isinstance(self.state[name], torch.nn.Parameter):
                self.state[name] = torch.nn.Parameter(self.state[name].clone(), requires_grad=True)

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters ``train_weights`` made, by the model's names."""
        return {name: t for name, t in self.state.items() if isinstance(t, torch.nn.Parameter)}

    def rank_tensors(self) -> list[torch.Tensor]:
        """This rank's tensors in the order the program takes them: what compiled callables read at every call, so
        that ``load_weights`` after ``compile`` takes effect."""
        return [self.state[gi.target] for gi in self.ctx.inputs if gi.is_model_tensor]

    def _checkpoint_tensors(self) -> tuple[dict, list[str]]:
        """What a checkpoint must hold (name -> global shape and dtype), and the buffers computed instead."""
        expected, computed = {}, []
        for node, graph_input in self.ctx.placeholder_inputs(self.graph_module).items():
            if not graph_input.is_model_tensor:
                continue
            if graph_input.persistent:
                expected[graph_input.target] = (node.meta["global_shape"], node.meta["val"].dtype)
            else:
                computed.append(graph_input.target)
        on_meta = [name for name in computed if self.state[name].is_meta]
        if on_meta:
            raise CheckpointError(f"non-persistent buffers {on_meta} are on the meta device and no checkpoint holds "
                                  "them (partition computes them only for diffusers models); set them first: "
                                  "partitioned.state[name] = tensor")
        return expected, computed

    @property
    def mesh(self):
        return self.ctx.mesh

    @property
    def input_fingerprint(self) -> str:
        """How each call's input values are compared between ranks: "sample", "full" or "off" (set it alike on
        every rank; its specialisations share it)."""
        return self.guard.fingerprint

    @input_fingerprint.setter
    def input_fingerprint(self, mode: str) -> None:
        self.guard.fingerprint = check_fingerprint(mode)

    @property
    def slice_specs(self) -> dict[str, dict]:
        """How each sharded parameter/buffer is cut: FQN -> {mesh axis: placement}."""
        return self.ctx.slice_specs

    @property
    def linear_styles(self) -> dict[str, str]:
        """The decision for every Linear: module path -> colwise / colwise packed [...] / rowwise / replicate."""
        return self.ctx.linear_styles

    def explain(self, module_path: str | None = None) -> str:
        """Why a Linear was planned the way it was, whether an attention module is sequence-sharded and why not, or
        (on a dp/cfg axis) whether an input is split along the batch and why not; with no path, every decision, a
        line each."""
        if module_path is None:
            lines = [self.explain(path) for path in [*self.ctx.linear_styles, *self.ctx.sequence_attention,
                                                     *self.ctx.batch_split]]
            return "\n".join(lines + ([f"between the tp regions: {self.ctx.tp_sequence}"] if self.ctx.tp_sequence
                                      else []) + self._value_lines())
        if module_path in self.ctx.sequence_attention:
            return f"{module_path}: {self.ctx.sequence_attention[module_path]}"
        if module_path in self.ctx.batch_split:
            return f"input {module_path}: {self.ctx.batch_split[module_path]}"
        style = self.ctx.linear_styles.get(module_path)
        if style is None:
            known = sorted([*self.ctx.linear_styles, *self.ctx.sequence_attention])
            raise NotFound(f"no Linear or attention module at {module_path!r}{did_you_mean(module_path, known)}; "
                           f"known modules look like {known[:3]}")
        reason = self.ctx.replicated_because.get(module_path)
        chunked = self.ctx.chunked.get(module_path)
        scattered = self.ctx.reduce_scattered.get(module_path)
        return f"{module_path}: {style}" + (f" (column sharding stopped at {reason})" if reason else "") + \
            (f"; its all_reduce {chunked}" if chunked else "") + (f"; its sum {scattered}" if scattered else "")

    def _value_lines(self) -> list[str]:
        """What the trace read of its inputs' values: the inputs pinned, and the guards replayed per call."""
        names = input_names(self.traced.in_spec)
        lines = [f"traced for the values of {names[i]} (read: {self.traced.value_reads[0]})"
                 for i in sorted(self.traced.values)]
        guards = self.traced.guards.guards if self.traced.guards is not None else []
        return lines + [f"guard: {guard.describe()}; a call where it comes out otherwise is traced again"
                        for guard in guards]

    def verify(self, *args, rtol: float = 1e-4, atol: float = 1e-5, **kwargs):
        """Run this rank's program and the unpartitioned model on the same forward arguments and compare every
        value this rank computes with the model's, cut to this rank's part. On a difference, raise
        ``VerificationError`` on every rank naming the first node that differs (its model source line, its
        placements and the pass that decided them, the error). Every rank must call it; the model passed to
        ``partition`` must still be alive. Returns what was compared. ``rtol``/``atol`` are relative to the
        reference's magnitude (loosen them for bf16)."""
        from .runtime.verify import verify

        model = self.source() if self.source is not None else None
        if model is None:
            raise VerificationError("verify compares with the model given to partition(), which is gone: keep a "
                                    "reference to it while verifying")
        with method_as_forward(model, self.method), self.guard.exclusive():
            return verify(self, model, args, kwargs, rtol=rtol, atol=atol)

    def report(self) -> Report:
        return build_report(self.graph_module, self.ctx)

    def collective_counts(self) -> Counter:
        """How many collectives of each (kind, mesh axis) one rank's program runs."""
        counts = Counter()
        for stat in collective_stats(self.graph_module):  # (not the whole report: it sizes every rank's weights)
            counts[(stat.kind, stat.axis)] += stat.count
        return counts

    def compile(self, backend: str = "eager", **options):
        """A callable taking the model's forward arguments and returning what its forward returns.
        ``backend``: "eager", "inductor" (options: ``regional``, ``compile_glue``), "neuron" (legalises and checks
        its rules, then needs torch-neuronx; options ``pad_sequence``, ``text_rows``) or "xla" (one process drives
        every device through XLA SPMD; option ``verify``); see ``partitioner.backends``."""
        from .runtime.module import PartitionedModule

        start = time.perf_counter()
        module = PartitionedModule(self, backend, options)
        self.seconds["compile"] = time.perf_counter() - start
        return module

    def lower(self, backend: str = "eager", **options):
        """The backend's program and what gives it its tensors at each call: this rank's program and shards for a
        backend run per rank, the global plan and the model's whole tensors (on the CPU) for one that drives every
        device itself."""
        chosen = backends.get(backend)
        chosen.validate(options)
        if chosen.takes == "global":
            if self.mesh.per_rank:
                raise BackendError(f"{backend!r} runs one global program (XLA SPMD), and this partition was planned for "
                                   "rank programs; partition for XLA's program by name: partition(model, "
                                   f"{self.mesh.sizes}, example_inputs, programs='global')")
            self.whole_tensors()  # fail now, not at the first call, when the whole tensors cannot be had
            with our_step(f"lowering to backend {backend!r}", BackendError):
                return chosen.lower(self.planned_graph, mesh=self.mesh, collectives=self.collective_counts(),
                                    **options), self.whole_tensors
        if not self.mesh.runnable:
            raise BackendError(f"this partition was planned on axis sizes ({self.mesh}); to run it with {backend!r}, "
                               "partition with a DeviceMesh on initialised process groups")
        _require_weights(self.state, "")
        devices = {t.device for t in self.state.values()}
        if len(devices) > 1:
            raise BackendError(f"this rank's tensors are on several devices {sorted(map(str, devices))}")
        place_graph_on(self.graph_module, devices.pop() if devices else self.mesh.device)
        with our_step(f"lowering to backend {backend!r}", BackendError):  # never a raw builtin from the backend
            return chosen.lower(self.graph_module, mesh=self.mesh, collectives=self.collective_counts(),
                                **options), self.rank_tensors

    def whole_tensors(self) -> list[torch.Tensor]:
        """The model's whole tensors in program order, on the CPU (what a backend that drives every device takes);
        read again after ``load_weights``."""
        if self._whole is None:
            state = self._whole_state()
            self._whole = [state[gi.target] for gi in self.ctx.inputs if gi.is_model_tensor]
        return self._whole

    def _whole_state(self) -> dict[str, torch.Tensor]:
        if self.global_state is None:
            raise BackendError("a backend that drives every device from one process (XLA SPMD) needs the whole "
                               "model: partition with the mesh as axis sizes, e.g. "
                               f"partition(model, {self.mesh.sizes}, example_inputs)")
        state = self.global_state
        if self.checkpoint is not None:  # the checkpoint last loaded, read whole
            path, strict = self.checkpoint
            expected, computed = self._checkpoint_tensors()
            state = load_shards(path, expected, {}, self.mesh, strict=strict)
            state.update({name: self.global_state[name] for name in computed})
        _require_weights(state, ": use a model with weights, or load_weights(checkpoint)")
        return {name: tensor.detach().cpu() for name, tensor in state.items()}


def _real_constants(partitioned: "Partitioned", state: dict, like: dict) -> dict[str, torch.Tensor]:
    """The constants of ``partitioned``'s trace that have values (a skeleton on the meta device traces meta ones),
    on the device of the tensors in ``like``."""
    device = next((t.device for t in like.values() if not t.is_meta), None)
    return {gi.target: state[gi.target].to(device) if device is not None else state[gi.target]
            for gi in partitioned.ctx.inputs if gi.kind == "constant" and gi.target in state
            and not state[gi.target].is_meta}


def _require_weights(state: dict[str, torch.Tensor], advice: str) -> None:
    meta = [name for name, t in state.items() if t.is_meta]
    if meta:
        raise MissingWeights(f"{len(meta)} tensors are on the meta device (e.g. {meta[0]!r}); the partition needs "
                              f"real weights to run{advice}")


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
        except DataDependentNumber:
            if traced.values_specialized:
                raise
            start = time.perf_counter()
            retraced = trace(model, example_inputs, specialize_values=True)
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
    lines = _plan_lines(partitioned, header) if partitioned is not None else None
    agree_on_plan(groups, lines, failure)
    # which partition: its number on these groups (two experts of one architecture, whose weights are loaded later,
    # plan alike) and its plan
    if groups is not None:
        groups.built += 1
    identity = PartitionIdentity(partitioned.model_name, groups.built if groups is not None else 0,
                                 hashlib.sha256("\n".join(lines).encode()).hexdigest()[:8])
    partitioned.guard = CallGuard(groups, spec.device, identity=identity)
    return partitioned


def _plan_lines(partitioned: Partitioned, header: list[str]) -> list[str]:
    """The plan ranks compare: the global graph with its placements and shapes, how many chunks each
    row-parallel all_reduce is issued in (a profile file that differs between hosts would make ranks issue
    different collectives) and the order each all_to_all sends its pieces in (read from the device's layout: ranks
    whose devices lay a value out differently would read each other's pieces wrong, with no error); device indices
    left out (each rank has its own GPU)."""
    device = re.compile(r"device\(type='(\w+)', index=\d+\)")
    chunks = [f"all_reduce of {path}: {how.split(' (')[0]}" for path, how in sorted(partitioned.ctx.chunked.items())]
    orders = [f"all_to_all of {node.args[0].name}: pieces in order {node.args[6]}"
              for node in partitioned.graph_module.graph.nodes if node.target is collectives.all_to_all_start]
    return [device.sub(r"device(type='\1')", line)
            for line in plan_lines(partitioned.planned_graph, header)] + chunks + orders


def _check_offline(partitioned: Partitioned, backend_checks, dump_dir) -> None:
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
                     buckets: dict | None = None, overlap: bool | dict | Overlap = True) -> Partitioned:
    """Run the passes over a trace, in place (copy ``traced`` to partition one trace for several meshes).
    ``plan``: ``_tp_plan``-style overrides, or a whole ``Plan`` to apply as it is."""
    with collector_skips_what_exists():
        ctx, gm, dump = decide(traced, mesh, model_name, plan=plan, dump_dir=dump_dir, bounds=bounds,
                               buckets=buckets, overlap=overlap)
        planned = copy_graph_module(gm)  # the global decision, kept for backends that partition themselves (XLA)
        gm = run_passes(gm, ctx, TO_RANK, dump)
    traced.graph_module, traced.inputs = gm, ctx.inputs
    partitioned = Partitioned(model_name, traced, ctx, planned)
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
        unknown = sorted(set(plan.sequence_seeds_by_axis or {}) - set(mesh.axis_names))
        if unknown:
            raise PartitionError(f"the plan's sequence_seeds_by_axis names mesh axes {unknown} that the mesh "
                                 f"{mesh.sizes} does not have; plan again for this mesh")
        overrides = plan.linear_overrides()
        ctx.plan = {path: style for path, (style, _, _) in overrides.items()}
        ctx.packed_overrides = {path: blocks for path, (_, blocks, _) in overrides.items() if blocks}
        ctx.unit_overrides = {path: unit for path, (_, _, unit) in overrides.items() if unit > 1}
        ctx.given_sequence_seeds = dict(plan.sequence_seeds) if plan.sequence_seeds is not None else None
        ctx.given_sequence_seeds_by_axis = plan.sequence_seeds_by_axis
        ctx.bounds = {**plan.bounds, **ctx.bounds}
    else:
        ctx.plan = dict(plan or {})
    dump = Dumper(dump_dir or os.environ.get("PARTITIONER_DUMP"), mesh.rank)
    gm = traced.graph_module
    dump("export", gm, ctx)
    return ctx, run_passes(gm, ctx, PLAN, dump), dump
