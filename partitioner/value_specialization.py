"""Value specialisation: trace a model whose Python code reads the values of its integer or boolean inputs.

torch.export traces with fake tensors, which have shapes but no values. A model that turns an input's values into
Python (``mask.sum(dim=1).tolist()`` to branch on ``len(set(lengths))``, Lumina2) or into a size
(``nonzero(mask)`` to drop padded text rows, Mochi) cannot be traced symbolically, and the host prologue cannot
take it either: the number sizes device ops. Such a model is traced for the values of one call instead.

While export runs, ``ValueShadow`` carries next to every fake tensor computed only from those inputs its real value
(computed on the side, on copies). Whatever Python reads from such a tensor (``item``, ``tolist``, ``bool``,
``nonzero``'s size) is the real value, and every tensor computed only from such inputs enters the graph as a
constant. The graph is then exact for those input values and no others: ``Traced.values`` keeps them, and every
call of the partition compares its inputs against them (``CompiledPartition`` refuses a call that differs; the
drop-in module traces again for it, as it does for new shapes).

Only integer and boolean inputs are specialised: they describe structure (masks, lengths, ids) and stay fixed over
a pipeline's denoising steps, while a float input (latents, a timestep) changes at every step. Metadata queries
(``shape``, ``dim()``, ``dtype``) read no values and are answered by the fake tensor.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

# Tensor methods and properties that answer from shape, dtype or device alone: the fake tensor answers them.
_METADATA = {"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
             "is_contiguous", "element_size", "is_floating_point", "is_complex", "get_device", "__len__", "type",
             "data_ptr", "untyped_storage", "__format__", "__repr__"}


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
    """Inside a trace: real values alongside the fake tensors computed only from the specialised inputs."""

    def __init__(self, package: str):
        super().__init__()
        self.real = WeakIdKeyDictionary()  # fake tensor -> its real value
        self.roots = WeakIdKeyDictionary()  # fake tensor -> the forward arguments it derives from
        self.reads: list[ValueRead] = []
        self.package = package  # the model's top-level package, for source lines

    def shadow(self, fake: torch.Tensor, real: torch.Tensor, name: str) -> None:
        self.real[fake] = real
        self.roots[fake] = (name,)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or _op_name(func).rsplit(".", 1)[-1] in _METADATA or not all(t in self.real for t in tensors):
            return func(*args, **kwargs)
        roots = tuple(sorted({root for t in tensors for root in self.roots[t]}))
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            real_args = pytree.tree_map_only(torch.Tensor, lambda t: self.real[t], (args, kwargs))
            real = func(*real_args[0], **real_args[1])
        self.reads.append(ValueRead(_op_name(func), roots, self._where()))
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(real)):
            return real  # Python reads a number, a list or a bool: the real one
        made = pytree.tree_map_only(torch.Tensor, lambda value: _constant(value, tensors[0].device), real)
        for fake, value in zip(pytree.tree_leaves(made), pytree.tree_leaves(real)):
            if isinstance(fake, torch.Tensor):
                self.real[fake], self.roots[fake] = value, roots
        return made

    def _where(self) -> str:
        frames = traceback.extract_stack()[:-2]
        ours = [f for f in frames if f"/{self.package}/" in f.filename] or \
            [f for f in frames if "/torch/" not in f.filename and "/partitioner/" not in f.filename]
        if not ours:
            return "no source line recorded"
        frame = ours[-1]
        return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


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
