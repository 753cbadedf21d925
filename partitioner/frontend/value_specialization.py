"""Value specialisation: trace a model whose Python code reads the values of its inputs.

torch.export traces with fake tensors, which have shapes but no values. A model that turns an input's values into
Python (``mask.sum(dim=1).tolist()`` to branch on ``len(set(lengths))``, Lumina2) or into a size
(``nonzero(mask)`` to drop padded text rows, Mochi) cannot be traced symbolically, and the host prologue cannot
take it either: the number sizes device ops. Such a model is traced for the values of one call instead.

While export runs, ``ValueShadow`` carries next to every fake tensor computed only from those inputs its real value,
computed on the side (on copies: the caller's tensors are never written) by the same ops. The graph still computes
those tensors; only three things take the real values:
- what Python reads (``item``, ``tolist``, ``bool``): the real numbers;
- an op whose output size depends on values (``nonzero``, ``unique``, a boolean index: its meta kernel cannot size
  it): its real result enters the graph as a constant;
- a boolean index by such a mask into any other tensor (``text[mask]``, rows reordered valid-first): the mask's
  positions enter as constant indices, the same rows in the same order, at a size the graph knows.
The graph is then exact for the values read and no others. What is read of integer and boolean inputs (masks,
lengths, ids: structure, fixed over a pipeline's denoising steps) pins those inputs: ``Traced.values`` keeps them
and every call of the partition compares its inputs against them. What is read of a float input (latents, a
timestep, an image embedding: they change at every step) pins only what was read: it becomes a guard
(``value_guards``), replayed from each call's inputs. ``CompiledPartition`` refuses a call that differs in either;
the drop-in module traces again for it, as it does for new shapes. An input that is only computed with, never read,
is not pinned. Factories (``zeros``, ``arange``, ``ones_like`` of a graph value) are followed as constants.

Refused (a ``TraceError`` naming the model's line), because the shadow could not follow it: a read of a tensor
(any view of its storage) written in place by an op the shadow does not compute (values from model weights, a
random fill). Random ops are never shadowed (their results would be frozen), nor uninitialised ones. Metadata
queries (``shape``, ``dim()``, ``dtype``) are answered by the fake tensor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import traceback
import types

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import InputError, TraceError, did_you_mean
from .value_guards import GuardTape, ValueGuard, ValueRead

# Tensor methods answered from shape, dtype or device alone (properties too: ``__get__``), unless they return a
# tensor (``x.T``, ``x.type(torch.float)``), which is then shadowed like any op's.
_METADATA = {"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
             "is_contiguous", "element_size", "is_floating_point", "is_complex", "get_device", "__len__", "type",
             "data_ptr", "untyped_storage", "__repr__", "__str__"}  # (a printed tensor: the fake's text)
# Ops whose results are random or undefined: never shadowed (their values would be frozen into the trace), and
# never allowed to write a tensor whose values are read.
_UNSHADOWED = {"rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal", "poisson",
               "binomial", "dropout", "feature_dropout", "alpha_dropout", "native_dropout", "rrelu", "uniform_",
               "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
               "dropout_", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
# Ops whose values come from their arguments that are not tensors (a tensor argument lends its shape and dtype only):
# followed even when made from graph values (``torch.zeros((batch, rows))``, ``ones_like(text[..., 0])``), as constants.
_VALUE_FREE = {"zeros", "ones", "full", "arange", "linspace", "logspace", "eye", "tensor", "as_tensor",
               "scalar_tensor", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full",
               "new_tensor"}
# Ops that answer Python with values (never a tensor): computed on the real values, a read.
_PYTHON_VALUES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__contains__",
                  "__format__", "numpy", "__array__", "equal", "allclose", "is_nonzero"}
_IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                       "__imatmul__"}


def _storage(tensor: torch.Tensor) -> StorageWeakRef | None:
    """The storage a tensor's values live in (views share it), or None for one without a storage."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _value_free(name: str, args, tensors: list[torch.Tensor]) -> bool:
    """Whether an op's values come from its arguments that are not tensors: a factory given no tensor, or a
    ``*_like``/``new_*`` op whose one tensor is the one it takes its shape and dtype from."""
    if name not in _VALUE_FREE:
        return False
    lends_shape = name.endswith("_like") or name.startswith("new_")
    return not tensors or (lends_shape and len(tensors) == 1 and bool(args) and tensors[0] is args[0])


def _on_host(arguments):
    """An op's arguments with every device the host's: the shadow computes on the host whatever the trace's device."""
    arguments = pytree.tree_map_only(torch.device, lambda _: torch.device("cpu"), arguments)
    if isinstance(arguments, dict) and isinstance(arguments.get("device"), str):
        arguments = {**arguments, "device": "cpu"}
    return arguments


def _written(name: str, args, kwargs):
    """The tensor an op writes in place (its ``self`` or ``out``), or None."""
    if kwargs.get("out") is not None:
        return kwargs["out"]
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return args[0] if args and isinstance(args[0], torch.Tensor) else None
    return None


def shadowable(value) -> bool:
    """Whether a forward argument's values can be followed beside the trace: a tensor with values (not meta)."""
    return isinstance(value, torch.Tensor) and not value.is_meta


def model_line(frames: list[traceback.FrameSummary], package: str) -> str | None:
    """The innermost of ``frames`` in the model's own package (diffusers' file and line), or else in any file
    outside torch and partitioner, as ``file:line in function: code``; None when there is none."""
    ours = [f for f in frames if f"/{package}/" in f.filename] or \
        [f for f in frames if "/torch/" not in f.filename and "/partitioner/" not in f.filename]
    if not ours:
        return None
    frame = ours[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _op_name(func) -> str:
    """``Tensor.tolist`` for a tensor method or property, ``torch.nonzero`` for a function."""
    name = getattr(func, "__name__", repr(func))
    return f"Tensor.{name}" if hasattr(func, "__objclass__") else f"torch.{name}"


def _constant(real: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``real`` as a constant of the trace (export lifts a tensor made from host data into the graph's constants),
    moved to ``device``, where the traced tensors are (meta, for a model traced on meta: the copy is a graph op,
    pointed at the partition's device when it runs, and the constant keeps the values)."""
    with _disable_current_modes():  # host data, read outside the fake mode
        copied = real.detach().cpu()
        try:
            data = copied.numpy().copy()
        except TypeError:  # no numpy dtype (bfloat16): through Python lists
            data = copied.tolist()
    made = torch.from_numpy(data) if not isinstance(data, list) else torch.tensor(data, dtype=copied.dtype)
    return made if device.type == "cpu" else made.to(device)


class _Pending:
    """An op's real result, computed when a read first needs it: the shadow follows every op of the inputs, but most
    values are never read (an attention mask over a whole 50k-row sequence is followed, never computed)."""

    def __init__(self, compute, needs=()):
        self._compute, self._leaves = compute, None
        self.needs = [t for t in pytree.tree_leaves(needs) if isinstance(t, torch.Tensor)]  # the values it reads

    def value(self) -> list:
        if self._leaves is None:
            self._leaves = pytree.tree_leaves(self._compute())
            self._compute, self.needs = None, []  # (frees the traced tensors it held)
        return self._leaves


class ValueShadow(TorchFunctionMode):
    """Inside a trace: real values alongside the fake tensors computed only from the specialised inputs.

    Which inputs a value derives from is kept per storage, not per tensor: a write through one view reaches every
    view of that storage, and so do the inputs it brings. A storage written by an op the shadow cannot compute is
    stale: a read of it is refused, naming that write (a value that is never read may be written any way)."""

    def __init__(self, package: str):
        super().__init__()
        self.real = WeakIdKeyDictionary()  # fake tensor -> its real value
        self.storage_roots: dict[StorageWeakRef, set[str]] = {}  # storage -> forward arguments its values derive from
        self.stale: dict[StorageWeakRef, str] = {}  # storage -> why its real values are not the graph's
        self.reads: list[ValueRead] = []  # reads of integer and boolean inputs: those inputs are pinned
        self.guarded: set[str] = set()  # float inputs: a read of them is a guard, replayed per call
        self.guards: list[ValueGuard] = []
        self.tape = GuardTape()
        self.pending = WeakIdKeyDictionary()  # fake tensor -> (its op's _Pending, which leaf of the result)
        self.unevaluated: list[_Pending] = []
        self.package = package  # the model's top-level package, for source lines

    def shadow(self, fake: torch.Tensor, real: torch.Tensor, name: str) -> None:
        self.real[fake] = real
        self._add_roots(fake, {name})
        self.tape.input(fake, name)
        if real.is_floating_point() or real.is_complex():
            self.guarded.add(name)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        short = name.rsplit(".", 1)[-1]
        if short in ("__getitem__", "__setitem__") and len(args) > 1:
            args = (args[0], self._bounds_as_numbers(args[1]), *args[2:])
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        shadowed = [t for t in tensors if self._known(t)]
        written = _written(short, args, kwargs)
        followed = bool(shadowed) and len(shadowed) == len(tensors) and short not in _UNSHADOWED
        if written is not None and self._roots(written) and not (followed and self._known(written)):
            self._mark_stale(written, f"{name} writes in place into a tensor computed from "
                                      f"{', '.join(sorted(self._roots(written)))}, whose values the trace reads; the "
                                      f"trace cannot compute that write beside the graph ({self._where()})")
        if short == "__getitem__" and written is None:
            index, real_index = self._masks_as_indices(args[1], tensors[0].device)
            if real_index is not None:  # rows picked by a specialised mask (valid rows first): that many, here
                result = func(args[0], index)
                if self._known(args[0]) and real_index is not False:  # the rows' values followed too (not read)
                    data = args[0]
                    later = _Pending(lambda: self._value(data)[real_index], data)
                    roots = set().union(*(self._roots(t) for t in shadowed))
                    self._follow(func, args, kwargs, result, later, roots, self._stale_of(shadowed), False)
                return result
        if not followed and written is None and _value_free(short, args, tensors):
            result = func(*args, **kwargs)  # values from its arguments that are not tensors alone: a constant
            later = _Pending(lambda: self._value_free(func, args, kwargs))
            self._follow(func, args, kwargs, result, later, set(), None, False)
            return result
        if not followed:  # not computed from the specialised inputs alone: the graph's value only
            return func(*args, **kwargs)
        roots = set().union(*(self._roots(t) for t in shadowed))
        stale = self._stale_of(shadowed)
        if short in _METADATA:
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor):  # a view or a conversion: shadowed as any op
                self._follow(func, args, kwargs, result, _Pending(lambda: self._real(func, args, kwargs),
                                                                  (args, kwargs)), roots, stale, False)
            return result
        if short in _PYTHON_VALUES:  # Python reads a number, a list or a bool: the real one
            real = self._real(func, args, kwargs)
            self._read(name, roots, stale, self.tape.record(func, args, kwargs, real, False), real)
            return real
        if written is None and self._sized_by_values(func, args, kwargs):
            real = self._real(func, args, kwargs)
            self._read(name, roots, stale, self.tape.record(func, args, kwargs, real, False), real)
            made = pytree.tree_map_only(torch.Tensor, lambda value: _constant(value, tensors[0].device), real)
            self._register(made, real, roots, None)
            return made
        if written is not None:  # written now, on the real values: what was computed before it reads them first
            self._evaluate_pending()
            real = self._real(func, args, kwargs)
            result = func(*args, **kwargs)
            self._follow(func, args, kwargs, result, real, roots, stale, True)
            return result
        result = func(*args, **kwargs)  # the graph computes it; the shadow follows, computing it when read
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(result)):
            real = self._real(func, args, kwargs)  # (an op that answers Python that _PYTHON_VALUES lacks)
            self._read(name, roots, stale, self.tape.record(func, args, kwargs, real, False), real)
            return real
        self._follow(func, args, kwargs, result, _Pending(lambda: self._real(func, args, kwargs), (args, kwargs)),
                     roots, stale, False)
        return result

    def _follow(self, func, args, kwargs, result, real, roots: set[str], stale: str | None, writes: bool) -> None:
        """Keep ``real`` (or how to compute it) beside the graph's ``result``; write the op on the guards' tape."""
        self.tape.record(func, args, kwargs, result, writes)
        self._register(result, real, roots, stale)

    def _known(self, tensor: torch.Tensor) -> bool:
        """Whether the shadow follows ``tensor``: its real value is known or can be computed."""
        return tensor in self.real or tensor in self.pending

    def _value(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s real value, computed now if it was not yet, with what it needs first (in a loop: a chain
        of pending ops may be longer than Python's recursion limit)."""
        stack = [tensor]
        while stack:
            last = stack[-1]
            if last in self.real:
                stack.pop()
                continue
            pending, leaf = self.pending[last]
            missing = [t for t in pending.needs if t not in self.real]
            if missing:
                stack.extend(missing)
                continue
            self.real[last] = pending.value()[leaf]
            stack.pop()
        return self.real[tensor]

    def _evaluate_pending(self) -> None:
        for pending in self.unevaluated:
            pending.value()
        self.unevaluated.clear()

    def _read(self, what: str, roots: set[str], stale: str | None, step: int, real) -> None:
        """Python took ``real`` from values derived from ``roots`` (the tape's ``step``): a float input makes it a
        guard, integer and boolean ones are pinned; one that derives from constants alone depends on nothing."""
        if stale is not None:
            raise TraceError(stale)
        read = ValueRead(what, tuple(sorted(roots)), self._where())
        if roots & self.guarded:
            self.guards.append(ValueGuard(read, step, real))
        elif roots:
            self.reads.append(read)

    def _bounds_as_numbers(self, index):
        """``index`` (of ``tensor[index]``) with each slice bound that is a number the shadow follows
        (``text[:, :lengths[0]]``, ``mask[i, :lengths[i]] = True``) replaced by its real value: a read, as
        ``int(bound)`` is, so the cut has a size the graph knows. (Torch takes such a bound in C++, where no
        ``__index__`` is called that the shadow would see.)"""
        parts = index if isinstance(index, tuple) else (index,)
        numbers = []
        for part in parts:
            if isinstance(part, slice):
                part = slice(*(self._number(bound) for bound in (part.start, part.stop, part.step)))
            numbers.append(part)
        return tuple(numbers) if isinstance(index, tuple) else numbers[0]

    def _number(self, bound):
        if not (isinstance(bound, torch.Tensor) and bound.dim() == 0 and not bound.is_floating_point()
                and self._known(bound)):
            return bound
        real = operator.index(self._value(bound))  # (an int, as the replayed __index__ gives: True is 1)
        step = self.tape.record(torch.Tensor.__index__, (bound,), {}, real, False)
        self._read("a slice bound", self._roots(bound), self._stale_of([bound]), step, real)
        return real

    def _masks_as_indices(self, index, device: torch.device) -> tuple[object, object]:
        """``index`` (of ``tensor[index]``) with every boolean mask computed from the specialised inputs replaced by
        the positions it selects (``mask.nonzero(as_tuple=True)``, constants): the same rows, in the same order,
        but as many as this call's mask selects, a size the graph knows (a reordering of text rows by their mask
        before an attention); each is a read of its mask. Also the index for the real values (False if another of
        its tensors has none), or None when it has no such mask."""
        parts = index if isinstance(index, tuple) else (index,)
        replaced, real, found = [], [], False
        for part in parts:
            if isinstance(part, torch.Tensor) and part.dtype == torch.bool and self._known(part):
                mask = self._value(part)
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    positions = mask.nonzero(as_tuple=True)
                step = self.tape.record(torch.Tensor.nonzero, (part,), {"as_tuple": True}, positions, False)
                self._read("boolean index", self._roots(part), self._stale_of([part]), step, positions)
                replaced.extend(_constant(p, device) for p in positions)
                real.extend(positions)
                found = True
            else:
                replaced.append(part)
                real.append((self._value(part) if self._known(part) else False) if isinstance(part, torch.Tensor)
                            else part)
        if not found:
            return index, None
        return tuple(replaced), (False if any(r is False for r in real) else tuple(real))

    def _stale_of(self, tensors: list[torch.Tensor]) -> str | None:
        """Why the real values of one of ``tensors`` are not the graph's, or None."""
        return next((self.stale[s] for s in map(_storage, tensors) if s in self.stale), None)

    def _roots(self, tensor: torch.Tensor) -> set[str]:
        reference = _storage(tensor)
        if reference is None or reference not in self.storage_roots:
            return set()
        if reference.expired():  # (a freed storage whose address a new one took)
            del self.storage_roots[reference]
            self.stale.pop(reference, None)
            return set()
        return self.storage_roots[reference]

    def _add_roots(self, tensor: torch.Tensor, roots: set[str]) -> None:
        reference = _storage(tensor)
        if reference is not None:
            self.storage_roots[reference] = self._roots(tensor) | roots

    def _mark_stale(self, tensor: torch.Tensor, why: str) -> None:
        reference = _storage(tensor)
        if reference is not None:
            self.stale.setdefault(reference, why)

    def _real(self, func, args, kwargs):
        """The op on the real values, on the host (a device argument, the traced one, is the host's there)."""
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, self._value, (args, kwargs))
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return func(*_on_host(real_args), **_on_host(real_kwargs))

    @staticmethod
    def _value_free(func, args, kwargs):
        """A value-free op's real result: its tensor arguments lend shape and dtype only; made on the host."""
        blank = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # noqa: E731
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            args, kwargs = pytree.tree_map_only(torch.Tensor, blank, (args, kwargs))
            return func(*_on_host(args), **_on_host(kwargs))

    def _register(self, fake, real, roots: set[str], stale: str | None) -> None:
        """``real``: the values, or a ``_Pending`` that computes them."""
        if isinstance(real, _Pending):
            self.unevaluated.append(real)
            leaves = [(f, i) for i, f in enumerate(pytree.tree_leaves(fake))]
        else:
            leaves = list(zip(pytree.tree_leaves(fake), pytree.tree_leaves(real)))
        for f, r in leaves:
            if not isinstance(f, torch.Tensor):
                continue
            if isinstance(real, _Pending):
                if any(f is t for t in real.needs):  # an op that returns its input (``x.to(x.dtype)``): no change
                    continue
                self.pending[f] = (real, r)
            elif isinstance(r, torch.Tensor):
                self.real[f] = r
            else:
                continue
            self._add_roots(f, roots)
            if stale is not None:
                self._mark_stale(f, stale)

    @staticmethod
    def _sized_by_values(func, args, kwargs) -> bool:
        """Whether the op's output shape depends on its inputs' values: its meta kernel cannot compute it (as for
        nonzero, unique, masked_select, a boolean index)."""
        meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            try:
                meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, meta, (args, kwargs))
                func(*meta_args, **meta_kwargs)
            except Exception:  # (meta kernels refuse data-dependent sizes)
                return True
        return False

    def _where(self) -> str:
        return model_line(traceback.extract_stack()[:-2], self.package) or "no source line recorded"


def shadowing_forward(model: torch.nn.Module, shadow: ValueShadow, real: dict[str, torch.Tensor], name_of):
    """``model.forward`` that gives ``shadow`` the real values of the keyword arguments named in ``real`` (by
    ``name_of(pytree path)``, e.g. ``encoder_attention_mask``) before running under it. The shadow computes on
    copies: its in-place ops must not write the caller's tensors."""
    original = model.forward
    copies = {name: value.detach().cpu().clone() for name, value in real.items()}  # (on the host)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        for path, leaf in pytree.tree_flatten_with_path(kwargs)[0]:
            if name_of(path) in copies and isinstance(leaf, torch.Tensor):
                shadow.shadow(leaf, copies[name_of(path)], name_of(path))
        with shadow:
            return original(*args, **kwargs)

    return forward


@contextlib.contextmanager
def forward_replaced(model: torch.nn.Module, forward):
    """``model.forward`` is ``forward`` inside the block; an instance's own ``forward`` (a hook library's) is put
    back after it."""
    own = model.__dict__.get("forward", _NONE)
    model.forward = forward
    try:
        yield
    finally:
        if own is _NONE:
            del model.forward
        else:
            model.forward = own


_NONE = object()


@contextlib.contextmanager
def method_as_forward(model: torch.nn.Module, method: str):
    """``model.<method>`` as its forward inside the block: the traced entry (a VAE's ``decode`` or ``encode``), with
    the model's own parameter names."""
    if method == "forward":
        yield
        return
    function = getattr(type(model), method, None)  # the class's: an instance may hold a stand-in for it
    if not callable(function) or method.startswith("_"):
        public = [name for name, member in inspect.getmembers(type(model), callable) if not name.startswith("_")]
        raise InputError(f"{type(model).__name__} has no public method {method!r} to trace"
                         f"{did_you_mean(method, public)}; give method= the name of one, e.g. 'decode'")
    with forward_replaced(model, types.MethodType(function, model)):
        yield
