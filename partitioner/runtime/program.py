"""Calling a lowered rank graph with the model's own forward arguments, and returning what forward returns."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, NamedTuple

import sympy
import torch
import torch.utils._pytree as pytree

from ..errors import BackwardUnsupported, InputError, our_step
from ..frontend.padding import pad_dim
from ..frontend.trace import argument_name, bind_forward
from ..frontend.state_objects import is_state_object, write_back
from .agreement import PendingAgreement
from .fingerprints import call_signature, same_constant, value_digest
from .gradients import refusing_backward, wants_gradients


class CompiledPartition:
    """``compiled(*args, **kwargs)`` flattens the forward arguments as at trace time, checks them, agrees with the
    other ranks that every rank accepts its call, adds this rank's weight shards, runs the lowered graph and
    rebuilds the forward's output (tuple or output dataclass).

    The weights are read from the partition at every call (``tensors``, default ``Partitioned.rank_tensors``), so
    ``Partitioned.load_weights`` after compile takes effect."""

    def __init__(self, lowered: Callable, partitioned, backend: str, tensors: Callable | None = None,
                 options: dict | None = None):
        from .preflight import Preflight

        self.lowered = lowered
        self.partitioned = partitioned
        self.backend = backend
        self.options = dict(options or {})  # the backend's, for the training copy too
        self.tensors = tensors or partitioned.rank_tensors
        self.host = partitioned.ctx.host  # HostProgram: data-dependent ops run on the CPU before the device graph
        self.stats = getattr(lowered, "stats", None)  # compilation counts, for backends that compile
        self.traced = traced = partitioned.traced
        self.owner = partitioned.model_name
        self.guard = partitioned.guard
        state = self.tensors()
        self.has_state = bool(state)
        self.device = state[0].device if state else torch.device("cpu")  # where this rank computes
        self.user_index = [gi.target for gi in traced.inputs if gi.kind == "user"]
        placeholders = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        self.user_vals = [n.meta.get("val") for n, gi in zip(placeholders, traced.inputs) if gi.kind == "user"]
        self.names = names = input_names(traced.in_spec)
        self.user_names = [names[i] for i in self.user_index]
        # flat argument index -> {dim: padded size}: dims served up to their bucket, padded with zeros per call
        self.padded = {}
        for name, dim in partitioned.ctx.buckets:
            if name in self.user_names:
                position = self.user_names.index(name)
                shape = self.user_vals[position].shape
                self.padded.setdefault(self.user_index[position], {})[dim] = shape[dim]
        self.preflight = Preflight(partitioned.planned_graph, partitioned.ctx.inputs, names,
                                   partitioned.ctx.padding_reads)

    @functools.cached_property
    def training(self) -> Training:
        """The program a call that records gradients runs (the training copy, ``passes.differentiate``), or why
        ``backward`` through this partition is refused."""
        from .. import backends
        from ..passes import differentiate

        if self.partitioned.trainable and not self.partitioned.trained_parameters():  # (before any copy is built)
            return Training(None, f"{self.owner}: the model is in training mode with every weight requiring grad; a "
                                  "partition trains the weights marked to train, the others frozen (as LoRA leaves "
                                  "them: model.requires_grad_(False), then the adapters). Call .eval() (or "
                                  "torch.no_grad()) for inference")
        backend = backends.BACKENDS.get(self.backend)
        if backend is None or backend.train is None or backend.takes != "rank":
            training = " and ".join(repr(name) for name, b in sorted(backends.BACKENDS.items()) if b.train)
            return Training(None, f"{self.owner}: backward through a partition runs on the {training} backends; "
                                  f"{self.backend!r} runs inference only. Call the model under torch.no_grad(), or "
                                  "compile it with one of those to train")
        try:
            with our_step("building the training copy of the program", BackwardUnsupported):
                graph = differentiate.run(self.partitioned.graph_module, self.partitioned.mesh, self.owner)
        except BackwardUnsupported as error:
            return Training(None, str(error))
        return Training(backend.train(graph, **self.options), None)

    @property
    def state(self) -> list[torch.Tensor]:
        return self.tensors()

    def flatten(self, args, kwargs, guard_outcomes: dict | None = None) -> tuple[list, list, bool | None, dict, dict]:
        """All flattened forward arguments, those the device graph takes, the call's return_dict, the real sizes of
        the dims padded to their bucket (flat argument index -> {dim: size}), and the arguments by name (the state
        objects the program writes into are the caller's own, there). ``guard_outcomes``: this
        call's ``Guards.failed`` already replayed (by the drop-in module, keyed by ``id`` of the guards)."""
        named, return_dict = call_arguments(self.traced.signature, args, kwargs, self.owner)
        leaves, spec = pytree.tree_flatten_with_path(((), named))
        flat = [leaf for _, leaf in leaves]
        names = [argument_name(path[1:]) for path, _ in leaves]
        if spec != self.traced.in_spec:
            self._raise_structure_mismatch(named)
        for index, value in self.traced.constant_args.items():
            given = flat[index]
            if not same_constant(given, value):
                raise InputError(f"{self.owner}: argument {names[index]}={given!r} differs from the traced "
                                 f"{value!r}; partition again with it in example_inputs")
        real_sizes = {}
        for index, expected in zip(self.user_index, self.user_vals):
            value = flat[index]
            if not isinstance(expected, torch.Tensor):
                continue
            if not isinstance(value, torch.Tensor):
                raise InputError(f"{self.owner}: {names[index]} must be a tensor (traced with one of shape "
                                 f"{list(expected.shape)}), got {type(value).__name__}")
            for dim, size in self.padded.get(index, {}).items():
                if value.dim() == expected.dim() and value.shape[dim] <= size:  # served: padded to the bucket
                    real_sizes.setdefault(index, {})[dim] = value.shape[dim]
                    value = flat[index] = pad_dim(value, dim, size)
            if tuple(value.shape) != tuple(expected.shape) or value.dtype != expected.dtype:
                raise InputError(f"{self.owner}: {names[index]} is {_tensor(value)}, traced with {_tensor(expected)}; "
                                 "this partition is static-shaped, partition again")
            if self.has_state and value.device != self.device:
                raise InputError(f"{self.owner}: {names[index]} is on {value.device}, this rank's weights on "
                                 f"{self.device}")
        for index, value in self.traced.values.items():  # the graph is exact for these values alone
            if not torch.equal(flat[index].detach().cpu(), value):
                raise InputError(f"{self.owner}: {names[index]} has other values than the ones this partition was "
                                 f"traced for, and the model reads them ({self.traced.value_reads[0]}); the module "
                                 "compile() returns traces again for new values, or partition again with these")
        guards, known = self.traced.guards, guard_outcomes or {}
        if guards is None:
            failed = None
        else:  # replayed here unless the caller already did for this call
            failed = known[id(guards)] if id(guards) in known else guards.failed(flat)
        if failed is not None:  # the model's code would have taken another branch (or another size) for this call
            raise InputError(f"{self.owner}: for this call's {', '.join(failed.read.inputs)}, {failed.describe()} "
                             "comes out otherwise than when this partition was traced; the module compile() returns "
                             "traces again for it, or partition again with these inputs")
        return flat, [flat[i] for i in self.user_index], return_dict, real_sizes, named

    def accepts(self, args, kwargs, guard_outcomes: dict | None = None) -> bool:
        """Whether this program takes the call as it is (its shapes, dtypes, structure and constants)."""
        try:
            self.flatten(args, kwargs, guard_outcomes)
        except InputError:
            return False
        return True

    def _raise_structure_mismatch(self, named: dict) -> None:
        traced = pytree.tree_unflatten([object()] * self.traced.in_spec.num_leaves, self.traced.in_spec)[1]
        for name, value in named.items():
            given, expected = pytree.tree_structure(value), pytree.tree_structure(traced[name])
            if given != expected:
                raise InputError(f"{self.owner}: argument {name!r} has structure {_describe(value)}, traced with "
                                 f"{_describe(traced[name])}; partition again with it in example_inputs")
        raise InputError(f"{self.owner}: the arguments' structure differs from the traced one")

    def run_host(self, flat: list) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Run the prologue on the CPU and pad its results to the bounds the device graph was built for; also
        return this call's data-dependent sizes."""
        outputs = self.host.prologue(*(flat[i].cpu() for i in self.host.inputs))
        padded = []
        for value, transfer in zip(outputs, self.host.transfers):
            for dim, expression in transfer.sizes.items():
                if value.shape[dim] > transfer.shape[dim]:
                    raise InputError(
                        f"{self.owner}: {transfer.name} has {value.shape[dim]} entries along dim {dim} "
                        f"({expression}), more than the bound {transfer.shape[dim]} the partition was built for; raise "
                        f"it with torch._check({expression} <= k) in the model or partition(..., bounds=...)")
            full = value.new_zeros(transfer.shape)
            full[tuple(slice(0, size) for size in value.shape)] = value
            padded.append(full.to(self.device))
        return padded, self.host.sizes(outputs)

    def check(self, args, kwargs, guard_outcomes: dict | None = None) -> "_Checked":
        """Every check of a call that can fail, before its first collective: the call's autocast as the partition's,
        its arguments bound, flattened, padded and compared with the trace, the host prologue run, every index
        checked. Raises ``InputError``."""
        check_autocast(self.partitioned)
        try:
            flat, user, return_dict, real_sizes, named = self.flatten(args, kwargs, guard_outcomes)
            hosted, sizes = self.run_host(flat) if self.host is not None else ([], {})
            self.preflight.check(flat, hosted, real_sizes)
            if hasattr(self.lowered, "check_inputs"):  # a backend's own input checks (Neuron's int32 casts)
                self.lowered.check_inputs(*self.tensors(), *user, *hosted)
        except InputError:
            raise
        except Exception as error:  # e.g. the host prologue on inputs it cannot take: still a rejection
            raise InputError(f"{self.owner}: checking this call's inputs failed: {type(error).__name__}: "
                             f"{error}") from error
        return _Checked(flat, user, return_dict, hosted, sizes, named)

    def agreement(self, checked: "_Checked") -> dict:
        """What the ranks compare for a checked call (``CallGuard.agree``'s keyword arguments)."""
        flat = checked.flat
        return dict(signature=call_signature(flat, structure=self.traced.in_spec),
                    exact={self.names[i] for i in self.traced.values},
                    values=[(self.names[i], v) for i, v in enumerate(flat) if isinstance(v, torch.Tensor)])

    def __call__(self, *args, **kwargs):
        with self.guard.exclusive():
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        self.guard.check_usable()
        checked, problem, agreement = None, None, dict(signature=0)
        try:  # every check of this call, before its first collective
            checked = self.check(args, kwargs)
            agreement = self.agreement(checked)
        except InputError as error:  # (its signature stays 0: the rejection is what the ranks learn)
            problem = error
        pending = self.guard.start(problem, describe=lambda: describe_call(
            bind_forward(self.traced.signature, args, kwargs, self.owner, InputError)), **agreement)
        return self.run(checked, pending)

    def run(self, checked: "_Checked", pending: PendingAgreement | None = None):
        """Run a call that every rank checked and agreed on (or whose agreement is ``pending``: settled before the
        program's first collective): with gradients recorded, the training copy (or, where backward cannot be
        exact, the inference program with ``backward`` refused by name)."""
        try:
            program, refusal = self._program_for(checked)
        except BaseException as error:  # (building the training copy failed): the ranks' verdict first
            if pending is not None:
                pending.settle_before_raising(error)
            raise
        if pending is not None and not getattr(program, "settles_agreement", False):
            pending.settle()  # a program that cannot settle it before its first collective runs after it
        with self.guard.running([self.partitioned.graph_module, self.lowered], pending), \
                torch.no_grad() if program is self.lowered else contextlib.nullcontext():
            out = list(program(*self.tensors(), *checked.user, *checked.hosted))
        if refusal is not None:  # never a silent wrong gradient: backward is refused by name
            out = refusing_backward(out, checked.flat, refusal)
        for index, dim, expression in self.host.trims if self.host is not None else ():
            out[index] = out[index].narrow(dim, 0, int(sympy.sympify(expression).subs(checked.sizes)))
        result = pytree.tree_unflatten(list(out), self.traced.out_spec)
        if self.traced.state_writes:  # what the forward wrote into its state objects, into the caller's
            result, written = result
            write_back(checked.named, self.traced.state_writes, written)
        if checked.return_dict is False and hasattr(result, "to_tuple"):
            return result.to_tuple()
        return result

    def _program_for(self, checked: "_Checked") -> tuple[Callable, str | None]:
        """The program a call runs, and why backward through it is refused (None: it is not)."""
        if not wants_gradients(checked.flat, self.partitioned.trainable):
            return self.lowered, None
        program, refusal = self.training
        if program is not None and any(value.is_floating_point() for value in checked.hosted):
            program, refusal = None, (f"{self.owner}: backward through the host prologue (data-dependent ops run "
                                      "on the CPU before the device graph) is not supported; call the model "
                                      "under torch.no_grad()")
        return (self.lowered if program is None else program), refusal


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype a call made now is autocast to on ``device_type``; None without autocast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def check_autocast(partitioned) -> None:
    """A call under another autocast than the partition's would run the traced ops in other dtypes: other results
    than the model's, and collectives of other sizes than a peer's (gloo aborts the process). Refused by name."""
    device_type = partitioned.mesh.device_type
    now = autocast_dtype(device_type)
    if now != partitioned.traced_autocast:
        said = {dtype: f"autocast({device_type}, {str(dtype).removeprefix('torch.')})" if dtype else "no autocast"
                for dtype in (now, partitioned.traced_autocast)}
        raise InputError(f"{partitioned.model_name}: called under {said[now]}, partitioned under "
                         f"{said[partitioned.traced_autocast]}; call it as it was partitioned on every rank, or "
                         "partition inside the autocast you call it with")


class Training(NamedTuple):
    """What a call that records gradients runs: the training program, or why backward is refused."""
    program: Callable | None
    refusal: str | None


class _Checked(NamedTuple):
    """A call that passed every check: its flattened arguments, the device graph's, the host prologue's results."""
    flat: list
    user: list
    return_dict: bool | None
    hosted: list
    sizes: dict
    named: dict  # the arguments by name


def call_arguments(signature, args, kwargs, owner: str) -> tuple[dict, bool | None]:
    """A call's arguments by name as the trace took them (``return_dict`` traced as True), and its return_dict."""
    named = bind_forward(signature, args, kwargs, owner, InputError)
    return_dict = named.get("return_dict")
    if "return_dict" in named:
        named["return_dict"] = True  # traced that way; converted back after the call
    return named, return_dict


def describe_call(named: dict) -> str:
    """A call's tensor shapes in words, for messages that compare calls."""
    described = []
    for path, leaf in pytree.tree_flatten_with_path(named)[0]:
        if isinstance(leaf, torch.Tensor):
            described.append(argument_name(path) + str(list(leaf.shape)))
        elif isinstance(leaf, torch.Generator):  # (seeded alike or not: its state's digest)
            described.append(f"{argument_name(path)}=Generator({leaf.device}, state {value_digest(leaf.get_state())})")
    return ", ".join(described)


def input_names(in_spec: pytree.TreeSpec) -> list[str]:
    """The flattened forward arguments' names (``hidden_states``, ``image_rotary_emb[0]``), in flattening order."""
    leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * in_spec.num_leaves, in_spec))[0]
    return [argument_name(path[1:]) for path, _ in leaves]


def _describe(value) -> str:
    """A pytree's shape in a line: containers kept, leaves as *, a state object as its type and attributes (never
    its repr, which holds a memory address)."""
    if is_state_object(value):
        return f"{type(value).__qualname__}({', '.join(f'{k}={_describe(v)}' for k, v in vars(value).items())})"
    if type(value) in (list, tuple):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    return str(pytree.tree_unflatten(["*"] * pytree.tree_structure(value).num_leaves, pytree.tree_structure(value)))


def _tensor(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
