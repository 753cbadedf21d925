"""Value specialisation: trace a model whose Python code reads the values of its integer or boolean inputs.

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
The graph is then exact for the values read and no others: ``Traced.values`` keeps the inputs they derive from,
and every call of the partition compares its inputs against them (``CompiledPartition`` refuses a call that
differs; the drop-in module traces again for it, as it does for new shapes). An input that is only computed with,
never read, is not pinned.

Refused (a ``TraceError`` naming the model's line), because the shadow could not follow it: a tensor the trace
reads (any view of its storage) written in place by an op the shadow does not compute (values from other inputs,
a random fill). Random ops are never shadowed (their results would be frozen), nor uninitialised ones. Only integer and boolean inputs are specialised: they describe structure (masks,
lengths, ids) and stay fixed over a pipeline's denoising steps, while a float input (latents, a timestep) changes
at every step. Metadata queries (``shape``, ``dim()``, ``dtype``) are answered by the fake tensor.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
import types
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import InputError, TraceError

# Tensor methods answered from shape, dtype or device alone (properties too: ``__get__``), unless they return a
# tensor (``x.T``, ``x.type(torch.float)``), which is then shadowed like any op's.
_METADATA = {"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
             "is_contiguous", "element_size", "is_floating_point", "is_complex", "get_device", "__len__", "type",
             "data_ptr", "untyped_storage"}
# Ops whose results are random or undefined: never shadowed (their values would be frozen into the trace), and
# never allowed to write a tensor whose values are read.
_UNSHADOWED = {"rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal", "poisson",
               "binomial", "dropout", "feature_dropout", "alpha_dropout", "native_dropout", "rrelu", "uniform_",
               "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
               "dropout_", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
_IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                       "__imatmul__"}


def _storage(tensor: torch.Tensor) -> StorageWeakRef | None:
    """The storage a tensor's values live in (views share it), or None for one without a storage."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _written(name: str, args, kwargs):
    """The tensor an op writes in place (its ``self`` or ``out``), or None."""
    if kwargs.get("out") is not None:
        return kwargs["out"]
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return args[0] if args and isinstance(args[0], torch.Tensor) else None
    return None


@dataclass(frozen=True)
class ValueRead:
    """One place where the traced code depended on an input's values."""
    what: str  # the op, e.g. "Tensor.tolist"
    inputs: tuple[str, ...]  # the forward arguments its value derives from
    where: str  # the model's source line

    def __str__(self) -> str:
        return f"{self.what} of {', '.join(self.inputs)} at {self.where}"


def specializable(value) -> bool:
    """Whether a forward argument's values can be specialised: an integer or boolean tensor with values (not meta)."""
    return (isinstance(value, torch.Tensor) and not value.is_meta and not value.is_floating_point()
            and not value.is_complex())


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


class ValueShadow(TorchFunctionMode):
    """Inside a trace: real values alongside the fake tensors computed only from the specialised inputs.

    Which inputs a value derives from is kept per storage, not per tensor: a write through one view reaches every
    view of that storage, and so do the inputs it brings."""

    def __init__(self, package: str):
        super().__init__()
        self.real = WeakIdKeyDictionary()  # fake tensor -> its real value
        self.storage_roots: dict[StorageWeakRef, set[str]] = {}  # storage -> forward arguments its values derive from
        self.reads: list[ValueRead] = []
        self.package = package  # the model's top-level package, for source lines

    def shadow(self, fake: torch.Tensor, real: torch.Tensor, name: str) -> None:
        self.real[fake] = real
        self._add_roots(fake, {name})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        short = name.rsplit(".", 1)[-1]
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        shadowed = [t for t in tensors if t in self.real]
        written = _written(short, args, kwargs)
        followed = bool(shadowed) and len(shadowed) == len(tensors) and short not in _UNSHADOWED
        if written is not None and self._roots(written) and not (followed and written in self.real):
            raise TraceError(f"{name} writes in place into a tensor computed from "
                             f"{', '.join(sorted(self._roots(written)))}, whose values the trace reads; the trace "
                             f"cannot compute that write beside the graph ({self._where()})")
        if not followed and short == "__getitem__" and written is None:
            index, roots = self._masks_as_indices(args[1], tensors[0].device)
            if roots:  # rows picked by a specialised mask (valid rows first): that many, at these positions
                self.reads.append(ValueRead(name, tuple(sorted(roots)), self._where()))
                return func(args[0], index)
        if not followed:  # not computed from the specialised inputs alone: the graph's value only
            return func(*args, **kwargs)
        roots = set().union(*(self._roots(t) for t in shadowed))
        if short in _METADATA:
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor):  # a view or a conversion: shadowed as any op
                self._register(result, self._real(func, args, kwargs), roots)
            return result
        real = self._real(func, args, kwargs)
        if written is None and not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(real)):
            self.reads.append(ValueRead(name, tuple(sorted(roots)), self._where()))
            return real  # Python reads a number, a list or a bool: the real one
        if written is None and self._sized_by_values(func, args, kwargs, real):
            self.reads.append(ValueRead(name, tuple(sorted(roots)), self._where()))
            made = pytree.tree_map_only(torch.Tensor, lambda value: _constant(value, tensors[0].device), real)
            self._register(made, real, roots)
            return made
        result = func(*args, **kwargs)  # the graph computes it; the shadow follows (an in-place write too)
        self._register(result, real, roots)
        return result

    def _masks_as_indices(self, index, device: torch.device) -> tuple[object, set[str]]:
        """``index`` (of ``tensor[index]``) with every boolean mask computed from the specialised inputs replaced by
        the positions it selects (``mask.nonzero(as_tuple=True)``, constants): the same rows, in the same order,
        but as many as this call's mask selects, a size the graph knows (a reordering of text rows by their mask
        before an attention). The inputs those masks derive from, if any."""
        parts = index if isinstance(index, tuple) else (index,)
        replaced, roots = [], set()
        for part in parts:
            if isinstance(part, torch.Tensor) and part.dtype == torch.bool and part in self.real:
                roots |= self._roots(part)
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    positions = self.real[part].nonzero(as_tuple=True)
                replaced.extend(_constant(p, device) for p in positions)
            else:
                replaced.append(part)
        return (tuple(replaced), roots) if roots else (index, set())

    def _roots(self, tensor: torch.Tensor) -> set[str]:
        reference = _storage(tensor)
        if reference is None or reference not in self.storage_roots:
            return set()
        if reference.expired():  # (a freed storage whose address a new one took)
            del self.storage_roots[reference]
            return set()
        return self.storage_roots[reference]

    def _add_roots(self, tensor: torch.Tensor, roots: set[str]) -> None:
        reference = _storage(tensor)
        if reference is not None:
            self.storage_roots[reference] = self._roots(tensor) | roots

    def _real(self, func, args, kwargs):
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self.real[t], (args, kwargs))
            return func(*real_args, **real_kwargs)

    def _register(self, fake, real, roots: set[str]) -> None:
        for f, r in zip(pytree.tree_leaves(fake), pytree.tree_leaves(real)):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                self.real[f] = r
                self._add_roots(f, roots)

    def _sized_by_values(self, func, args, kwargs, real) -> bool:
        """Whether the op's output shape depends on its inputs' values: its meta kernel cannot compute it (as for
        nonzero, unique, masked_select, a boolean index) or computes another one."""
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self.real[t].to("meta"),
                                                          (args, kwargs))
            try:
                meta = func(*meta_args, **meta_kwargs)
            except Exception:  # (meta kernels refuse data-dependent sizes)
                return True
        shapes = lambda value: [tuple(t.shape) for t in pytree.tree_leaves(value)  # noqa: E731
                                if isinstance(t, torch.Tensor)]
        return shapes(meta) != shapes(real)

    def _where(self) -> str:
        return model_line(traceback.extract_stack()[:-2], self.package) or "no source line recorded"


def shadowing_forward(model: torch.nn.Module, shadow: ValueShadow, real: dict[str, torch.Tensor], name_of):
    """``model.forward`` that gives ``shadow`` the real values of the keyword arguments named in ``real`` (by
    ``name_of(pytree path)``, e.g. ``encoder_attention_mask``) before running under it. The shadow computes on
    copies: its in-place ops must not write the caller's tensors."""
    original = model.forward
    copies = {name: value.detach().clone() for name, value in real.items()}

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
        raise InputError(f"{type(model).__name__} has no public method {method!r} to trace; give method= the name of "
                         "one, e.g. 'decode'")
    with forward_replaced(model, types.MethodType(function, model)):
        yield
