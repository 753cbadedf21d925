"""What ``Partitioned.compile`` returns: a module a pipeline uses in place of the model it partitions.

``forward`` has the model's own signature (positional and keyword arguments, ``return_dict``, ``attention_kwargs``
where the model takes it; ``inspect.signature(module.forward)`` shows it, as pipelines read it), ``config``,
``dtype`` and ``device`` are the model's, and ``cache_context`` is diffusers' (a no-op: no cache hook runs).
``partitioner.parallelize`` installs a fuller stand-in (``pipelines.LazyPartition``) that partitions at the first
call and answers every other read from the model.

A call whose tensor shapes differ from the traced ones (another resolution or text length, more distinct timesteps
than the traced bucket holds) is served by a shape specialisation (``Partitioned.specialize``): the model's skeleton
(on the meta device) is traced again for the new shapes and the partition's own plan is applied to it, with this
rank's weights shared. Every rank builds it on the same call, and the ranks compare the new plan as ``partition``
does. Dims with ``buckets`` are padded to their next bucket first, so one program serves a whole bucket. At most
``max_specializations`` are kept besides the traced shapes, the least recently used dropped first;
``specializations`` (and ``Partitioned.report()``) say which were built and why.

The first call logs the time to first step on the ``partitioner`` logger (INFO), one line with its parts
(``first_step_line``); ``module.first_step`` holds it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch
import torch.utils._pytree as pytree

from ..errors import InputError, TraceError
from ..frontend.padding import pad_named
from ..frontend.state_objects import is_state_object
from ..frontend.trace import argument_name, bind_forward
from .fingerprints import call_signature, leaf_key, same_constant, value_digest
from .program import CompiledPartition, call_arguments, check_autocast, describe_call, input_names

log = logging.getLogger("partitioner")


def first_step_line(seconds: dict[str, float]) -> str:
    """'time to first step 41.2 s = partition 12.1 s (trace 6.0 s, passes 5.3 s) + load_weights 20.3 s + compile
    0.1 s + first call 8.4 s' from ``Partitioned.seconds`` (parts it lacks are left out; Inductor compiles at the
    first call)."""
    parts = [name for name in ("partition", "load_weights", "compile", "first call") if name in seconds]
    inside = ", ".join(f"{name} {seconds[name]:.1f} s" for name in ("trace", "passes") if name in seconds)
    text = " + ".join(f"{name} {seconds[name]:.1f} s" + (f" ({inside})" if name == "partition" and inside else "")
                      for name in parts)
    return f"time to first step {sum(seconds[name] for name in parts):.1f} s = {text}"


class PartitionedModule(torch.nn.Module):
    def __init__(self, partitioned, backend: str, options: dict, max_specializations: int = 8):
        super().__init__()
        self.train(partitioned.traced_training)
        lowered, tensors = partitioned.lower(backend, **options)
        self._first = CompiledPartition(lowered, partitioned, backend, tensors=tensors, options=options)
        self._partitioned, self._backend, self._options = partitioned, backend, dict(options)
        self._cache: OrderedDict = OrderedDict()  # call shape signature -> CompiledPartition
        self.max_specializations = max_specializations
        self.specializations: dict[str, str] = {}
        self.config = partitioned.model_config
        signature = self._first.traced.signature
        names = input_names(self._first.traced.in_spec)
        self._valued = {names[i] for i in self._first.traced.values}  # inputs whose values pick the program
        self._guards = [self._first.traced.guards] if self._first.traced.guards is not None else []  # so do these

        self.first_step: str | None = None

        def forward(*args, **kwargs):
            if self.first_step is not None:
                return self._call(*args, **kwargs)
            start = time.perf_counter()
            result = self._call(*args, **kwargs)
            self._partitioned.seconds["first call"] = time.perf_counter() - start
            self.first_step = first_step_line(self._partitioned.seconds)
            log.info("%s: %s", self._partitioned.model_name, self.first_step)
            return result

        for name, parameter in partitioned.trained_parameters().items():  # under the model's names
            _register_parameter(self, name, parameter, partitioned.model_name)

        forward.__signature__ = signature  # what pipelines inspect
        forward.__doc__ = f"{partitioned.model_name}.forward, partitioned over {partitioned.mesh}"
        self.forward = forward

    @property
    def partitioned(self):
        return self._partitioned

    @property
    def partitions(self) -> list:
        """The traced shapes' ``Partitioned``, then each shape specialisation kept (least recently used first)."""
        found = [self._partitioned]
        for compiled in self._cache.values():
            if all(compiled.partitioned is not seen for seen in found):
                found.append(compiled.partitioned)
        return found

    @property
    def program(self) -> CompiledPartition:
        """The program of the traced shapes alone: it refuses any other call with an ``InputError``."""
        return self._first

    def __getattr__(self, name: str):
        """The traced shapes' program answers what the module does not have (``stats``, ``lowered``, ``state``,
        ``preflight``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            first = self.__dict__.get("_first")
            if first is None or name.startswith("__"):
                raise
            return getattr(first, name)

    @property
    def dtype(self) -> torch.dtype:
        return self._partitioned.model_dtype

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers' ``CacheMixin.cache_context``, which Flux, Wan and QwenImage wrap each transformer call in: the
        partition runs no cache hook, so it is a no-op, as diffusers' own is without one."""
        yield

    @property
    def device(self) -> torch.device:
        return self._first.device

    def _call(self, *args, **kwargs):
        with self._partitioned.guard.exclusive():
            return self._call_once(args, kwargs)

    def _call_once(self, args, kwargs):
        """Every check a call can fail (its mode, binding its arguments, padding to buckets, choosing or checking the
        program) runs before the ranks' one agreement: a call rejected on any rank is rejected on every rank, and
        every rank builds a shape specialisation on the same call."""
        call = self._prepare(args, kwargs)
        pending = self._partitioned.guard.start(call.problem, describe=call.describe, **call.agreement)
        if call.compiled is None:
            if pending is not None:
                pending.settle()
            compiled = self._specialize(call.bucketed)  # every rank builds it, and compares its plan
            # kept under the key such a call has from now on (a new trace may add guards or read more values)
            self._remember(self._prepare(args, kwargs).key, compiled)
            return compiled(*args, **kwargs)
        out = call.compiled.run(call.checked, pending)
        self._remember(call.key, call.compiled)  # (once the ranks agreed on the call)
        return out

    def call_pair(self, first: tuple[tuple, dict], second: tuple[tuple, dict], member: int | None):
        """Two calls, ``(args, kwargs)`` each, that every rank checks and agrees on together; this rank runs the one
        at index ``member`` (None: neither). Returns (its output, True), or (the first call's output, False) where
        either call has no program yet: then every rank runs the first call alone, as an ordinary call (building
        its specialisation if it needs one; a guessed second call is never worth one). The halves of a cfg axis run
        a guidance pair this way (``runtime.guidance_pairs``): the program is replicated over that axis, so each
        half's collectives stay within it."""
        guard = self._partitioned.guard
        with guard.exclusive():
            guard.check_usable()
            calls = [self._prepare(*first), self._prepare(*second)]
            problem = next((call.problem for call in calls if call.problem is not None), None)
            guard.agree(problem, describe=lambda: "; ".join(f"{which} call: {call.describe()}" for which, call
                                                            in zip(("first", "second"), calls) if call.describe),
                        **_paired_agreement(calls))
            # (every rank agreed on which programs exist); a program that writes into its state objects runs as an
            # ordinary call: a predicted call's writes would land in a copy, on the other half's ranks only
            if any(call.compiled is None or call.compiled.traced.state_writes for call in calls):
                return self._call_once(*first), False
            for call in calls:
                self._remember(call.key, call.compiled)
            if member is None:
                return None, True
            return calls[member].compiled.run(calls[member].checked), True

    def _prepare(self, args, kwargs) -> "_Prepared":
        """A call checked on this rank, before any collective: the program it runs (None: a specialisation is
        needed), its checked arguments, what the ranks compare, or the problem every rank must learn."""
        owner = self._partitioned.model_name
        compiled = checked = bucketed = key = problem = None
        agreement, describe = dict(signature=0), None
        try:
            check_autocast(self._partitioned)  # (before a specialisation could be built for such a call)
            if self.training != self._partitioned.traced_training:
                modes = {True: "training mode", False: "eval mode"}
                raise InputError(f"{owner}: called in {modes[self.training]}, partitioned in "
                                 f"{modes[self._partitioned.traced_training]} (the mode is fixed when the model is "
                                 f"traced); call .{'eval' if self.training else 'train'}() on it, or partition the "
                                 f"model in {modes[self.training]}")
            named = bind_forward(self._first.traced.signature, args, kwargs, owner, InputError)
            describe = lambda: describe_call(named)  # noqa: E731
            buckets = self._partitioned.ctx.buckets
            key = _shape_signature(pad_named(named, buckets, owner, shapes_only=True))  # the program it runs on
            key += tuple(value_digest(t) for name, t in _tensors(named) if name in self._valued)
            flat = pytree.tree_leaves(((), named))
            outcomes = {id(guards): guards.failed(flat) for guards in self._guards}  # replayed once a call
            key += tuple(outcomes[id(guards)] is None for guards in self._guards)
            compiled = self._cache.get(key)
            if compiled is None:  # padded for real only to choose or build a program (the program pads each call)
                bucketed = pad_named(named, buckets, owner)
                if self._first.accepts((), bucketed, outcomes):
                    compiled = self._first
            if compiled is not None:
                checked = compiled.check(args, kwargs, outcomes)
                agreement = compiled.agreement(checked)
            else:  # every rank must specialise for the same shapes: agree first, as a call of the program would
                traced_named, _ = call_arguments(self._first.traced.signature, (), bucketed, owner)
                leaves, structure = pytree.tree_flatten(((), traced_named))  # (the spec a trace of it would take)
                agreement = dict(signature=call_signature(leaves, structure=structure),
                                 values=_tensors(traced_named), exact=set(self._valued), marker="a new specialisation")
        except InputError as error:
            problem = error
        except Exception as error:  # still a rejection, on every rank
            problem = InputError(f"{owner}: checking this call's inputs failed: {type(error).__name__}: {error}")
        if problem is not None:
            compiled, agreement = None, dict(signature=0)
        return _Prepared(compiled, checked, bucketed, key, agreement, describe, problem)

    def _remember(self, key, compiled: CompiledPartition) -> None:
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        self._evict()

    def _specialize(self, named: dict) -> CompiledPartition:
        shapes = "; ".join(self._differences(named))
        try:
            specialized = self._partitioned.specialize(((), named))
        except TraceError as error:  # the model itself cannot run these inputs
            why = str(error).splitlines()[0]
            raise InputError(f"{self._partitioned.model_name}: a call with {shapes or 'other arguments'} differs "
                             f"from the traced one and the model cannot be traced for it: {why}") from error
        names = input_names(specialized.traced.in_spec)  # (a trace for other shapes may read values the first did not)
        self._valued |= {names[i] for i in specialized.traced.values}
        if specialized.traced.guards is not None:
            self._guards.append(specialized.traced.guards)
        lowered, tensors = specialized.lower(self._backend, **self._options)
        padded = [f"{name} dim {dim} to {sizes}" for (name, dim), sizes in self._partitioned.ctx.buckets.items()]
        self.specializations[shapes] = ("shapes or values other than the traced ones: the plan applied to a new trace"
                                        + (f"; padded to buckets: {', '.join(padded)}" if padded else "")
                                        + (f" ({specialized.ctx.replanned})" if specialized.ctx.replanned else ""))
        self._partitioned.ctx.specializations = dict(self.specializations)
        return CompiledPartition(lowered, specialized, self._backend, tensors=tensors, options=self._options)

    def _differences(self, named: dict) -> list[str]:
        """How a call's arguments differ from the traced ones, an argument a line: its structure or type, each
        tensor's shape and dtype, each other value, and the values of inputs the program is specialised on."""
        first = self._first
        leaves = [None] * first.traced.in_spec.num_leaves
        for index, value in zip(first.user_index, first.user_vals):
            leaves[index] = value
        for index, value in first.traced.constant_args.items():
            leaves[index] = value
        traced = pytree.tree_unflatten(leaves, first.traced.in_spec)[1]
        found = []
        for name, value in named.items():
            was = traced.get(name)
            if pytree.tree_structure(value) != pytree.tree_structure(was):
                found.append(f"{name}={_value(value)} (traced: {_value(was)})")
                continue
            for (path, leaf), old in zip(pytree.tree_flatten_with_path(value)[0], pytree.tree_leaves(was)):
                where = name + pytree.keystr(path)
                if isinstance(leaf, torch.Tensor) != isinstance(old, torch.Tensor):
                    found.append(f"{where}={_value(leaf)} (traced: {_value(old)})")
                elif isinstance(leaf, torch.Tensor) and (leaf.shape != old.shape or leaf.dtype != old.dtype):
                    other_dtype = leaf.dtype != old.dtype
                    was = (f"{where}{list(old.shape)}" if leaf.shape != old.shape else "") + \
                        (f" {_dtype(old)}" if other_dtype else "")
                    found.append(f"{where}{list(leaf.shape)}" + (f" {_dtype(leaf)}" if other_dtype else "")
                                 + f" (traced: {was.strip()})")
                elif isinstance(leaf, torch.Tensor) and where in self._valued:
                    found.append(f"other values of {where}")
                elif not isinstance(leaf, torch.Tensor) and not same_constant(leaf, old):
                    found.append(f"{where}={leaf!r} (traced: {old!r})")
        failed = first.traced.guards.failed(pytree.tree_leaves(((), named))) if first.traced.guards else None
        if failed is not None:
            found.append(f"{failed.read.what} of {', '.join(failed.read.inputs)} at {failed.read.where} otherwise")
        return found

    def _evict(self) -> None:
        """Keep the traced shapes and the ``max_specializations`` most recently used others."""
        keep = max(1, self.max_specializations)  # (the one just used stays, even with max_specializations=0)
        others = [key for key, compiled in self._cache.items() if compiled is not self._first]
        for key in others[:max(0, len(others) - keep)]:
            del self._cache[key]


class _Prepared(NamedTuple):
    """A call checked on this rank (``PartitionedModule._prepare``)."""
    compiled: CompiledPartition | None  # the program it runs; None: a shape specialisation is needed (or a problem)
    checked: object  # the program's checked arguments
    bucketed: dict | None  # its arguments padded to the buckets (to build a specialisation from)
    key: tuple | None  # the program's key in the cache
    agreement: dict  # what the ranks compare (CallGuard.agree's keywords)
    describe: Callable[[], str] | None  # the call's shapes in words
    problem: InputError | None  # why this rank rejects the call


def _paired_agreement(calls: list[_Prepared]) -> dict:
    """What the ranks compare for two calls taken together (every rank, whichever it runs)."""
    if any(call.problem is not None for call in calls):
        return dict(signature=0)
    merged = dict(signature=call_signature([call.agreement["signature"] for call in calls]), values=[], exact=set(),
                  marker=" | ".join(call.agreement.get("marker", "") for call in calls))
    for which, call in zip(("first", "second"), calls):
        merged["values"] += [(f"{which}.{name}", value) for name, value in call.agreement.get("values", [])]
        merged["exact"] |= {f"{which}.{name}" for name in call.agreement.get("exact", ())}
    return merged


def _register_parameter(root: torch.nn.Module, name: str, parameter: torch.nn.Parameter, owner: str) -> None:
    """``parameter`` at the dotted ``name`` under ``root``, the modules on the way made as plain containers."""
    *path, leaf = name.split(".")
    top = path[0] if path else leaf
    if top not in root._modules and top not in root._parameters and hasattr(root, top):
        raise InputError(f"{owner}: the trained weight {name!r} would hide the compiled module's own {top!r}; "
                         "rename that module in the model to train it through a partition")
    for part in path:
        if part not in root._modules:
            root.add_module(part, torch.nn.Module())
        root = root._modules[part]
    root.register_parameter(leaf, parameter)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _value(value) -> str:
    """A value in a few words: a tensor's dtype and shape, anything else its repr (cut)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    text = f"{type(value).__qualname__}(...)" if is_state_object(value) else repr(value)  # (no memory address)
    return text if len(text) <= 60 else text[:57] + "..."


def _tensors(named: dict) -> list[tuple[str, torch.Tensor]]:
    leaves = pytree.tree_flatten_with_path(named)[0]
    return [(argument_name(path), leaf) for path, leaf in leaves
            if isinstance(leaf, torch.Tensor)]


def _shape_signature(named: dict) -> tuple:
    """A call's shape signature: its structure, every tensor's shape and dtype, every other leaf's value."""
    leaves, spec = pytree.tree_flatten(named)
    return str(spec), tuple(leaf_key(v, generator_state=False) for v in leaves)
