"""``Partitioned``: what ``partition`` returns: this rank's program and shards, the global plan, and what can be
asked of them (explain, report, verify, compile, load_weights, specialize)."""

from __future__ import annotations

import time
import weakref
from collections import Counter

import torch

from . import backends
from .decisions import LinearSharding
from .errors import (BackendError, CheckpointError, InputError, MissingWeights, NotFound, VerificationError,
                     did_you_mean, our_step)
from .frontend.trace import Traced
from .frontend.value_specialization import method_as_forward
from .passes.context import PassContext
from .planning.report import Report, build_report, collective_stats
from .runtime.agreement import CallGuard, agree_on_staging
from .runtime.checkpoint import load_shards
from .runtime.fingerprints import check_fingerprint
from .passes.device_layout import place_graph_on
from .runtime.program import autocast_dtype, input_names
from .runtime.weights import shard_state
from .tensor_parts import flattened_name
from .annotations import annotation


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
        self.weights_version = 0  # counts the changes of this rank's weights (load_weights, train_weights)
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
        self._specializer = None  # build.specialize, set by the build step that made this partition
        # what making it cost, on the way to its first step: trace, passes, partition, load_weights, compile
        # (and "first call", which the drop-in module adds and logs: ``runtime.module.first_step_line``)
        self.seconds: dict[str, float] = {"passes": sum(ctx.pass_seconds.values())}
        traced.state = {}

    def load_weights(self, path, *, device=None, strict: bool = True) -> "Partitioned":
        """Replace this rank's tensors by its slices of a safetensors checkpoint (a file, an index file or a
        diffusers model folder), keeping the checkpoint's dtypes, on ``device`` (default: the mesh's device).
        Non-persistent buffers (e.g. ``rope.inv_freq``) are not in checkpoints: they keep their computed values.
        Weights in training are written into (an optimizer holds them), in their own dtype.
        Nothing is replaced unless every tensor was found and read. ``compile(backend="xla")``, which drives every
        device from one process, reads the whole tensors from the same checkpoint when it runs.
        On a DeviceMesh every rank must call it: each rank reads and checks its shards into staging, the ranks
        agree, and every rank commits them or none does (a failure on any rank is a ``CheckpointError`` on every
        rank naming the rank and the file; the partition keeps its previous weights)."""
        self.guard.check_usable()
        staged, failure, start = None, None, time.perf_counter()
        try:
            expected, computed = self._checkpoint_tensors()
            aliases = {gi.target: flattened_name(gi.target, gi.part_of) for gi in self.ctx.inputs if gi.part_of}
            shards = load_shards(path, expected, self.slice_specs, self.mesh, strict=strict, aliases=aliases)
            device = torch.device(device) if device is not None else self.mesh.device
            shards.update({name: self.state[name] for name in computed})
            staged = {name: tensor.to(device) for name, tensor in shards.items()}
        except Exception as error:  # every rank learns it, and none commits
            failure = error if isinstance(error, CheckpointError) else \
                CheckpointError(f"{path}: loading failed: {type(error).__name__}: {error}")
        with self.guard.exclusive():  # (its exchange shares the mesh's groups with every call)
            agree_on_staging(self.guard, failure, f"load_weights({str(path)!r})")
        for name, weight in self.state.items():  # weights in training keep their identity (an optimizer holds them)
            if isinstance(weight, torch.nn.Parameter) and name in staged:  # (swapped: a meta one takes real data)
                torch.utils.swap_tensors(weight, torch.nn.Parameter(staged[name].to(weight.dtype)))
                staged[name] = weight
        self.state = staged
        self.weights_version += 1
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
        plan applied (its sequence seeds derived again where the new trace has no value for a seed's key), sharing
        this rank's weights, its process groups and its guard. Every rank must call it with inputs of the same
        shapes (inputs with ``buckets`` padded to a bucket already). (``build.specialize``: the build steps live
        there, and ``build`` hands itself over so that this module need not import it.)"""
        if self.skeleton is None or self._specializer is None:
            raise InputError(f"{self.model_name}: this partition serves only the traced shapes (it was not made by "
                             "partition() from a module); partition again for other shapes")
        specialized = self._specializer(self, example_inputs)
        self._children.append(weakref.ref(specialized))
        return specialized

    def train_weights(self, names) -> None:
        """This rank's tensors of the weights ``names`` (those the model marks to train) as parameters, sharded as the
        weights are, copies (an optimizer stepping them must not write into the model's own weights)."""
        self.weights_version += 1
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
                expected[graph_input.target] = (annotation(node).global_shape, node.meta["val"].dtype)
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
        """The decision for every Linear as text: module path -> colwise / colwise packed [...] / rowwise /
        replicate (``linear_decisions`` holds them as values)."""
        return {path: str(decided) for path, decided in self.ctx.linear_styles.items()}

    @property
    def linear_decisions(self) -> dict[str, LinearSharding]:
        """The decision for every Linear: module path -> ``LinearSharding`` (style, packed blocks, unit)."""
        return dict(self.ctx.linear_styles)

    def explain(self, module_path: str | None = None) -> str:
        """Why a Linear was planned the way it was, whether an attention module is sequence-sharded and why not, or
        (on a dp/cfg axis) whether an input is split along the batch and why not; with no path, every decision, a
        line each."""
        if module_path is None:
            lines = [self.explain(path) for path in [*self.ctx.linear_styles, *self.ctx.sequence_attention,
                                                     *self.ctx.batch_split]]
            return "\n".join(lines + ([f"between the tp regions: {self.ctx.tp_sequence}"] if self.ctx.tp_sequence
                                      else []) + self._quantised_lines() + self._value_lines())
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

    def _quantised_lines(self) -> list[str]:
        return [f"{weight}: quantised, held whole on every rank: read by {readers}, not as a Linear's weight"
                for weight, readers in self.ctx.whole_quantised.items()]

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
            if self.ctx.exchange_dtype is not None:
                raise BackendError(f"{backend!r} runs its own collectives, in the values' dtypes: exchange_dtype="
                                   f"{self.ctx.exchange_dtype} applies to rank programs only; partition without it")
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


def _require_weights(state: dict[str, torch.Tensor], advice: str) -> None:
    meta = [name for name, t in state.items() if t.is_meta]
    if meta:
        raise MissingWeights(f"{len(meta)} tensors are on the meta device (e.g. {meta[0]!r}); the partition needs "
                              f"real weights to run{advice}")
