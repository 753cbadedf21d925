"""Guards: what a trace read from its float inputs' values, replayed from each call's inputs.

A model may branch in Python on a float input (``if torch.all(image_embeds == 0)``: text-to-video or
image-to-video). Pinning that input's values would pin latents and timesteps too, which change at every step; what
the trace depends on is only the predicate. So while ``ValueShadow`` follows the ops computed from the inputs alone,
it writes them on a ``GuardTape``: each op, with the tensors it takes named by slot. A read of a value derived from a
float input becomes a ``ValueGuard``: the tape's step that read it and what it read (``True``, a number, the
positions a mask selected). ``Guards.failed`` replays, on the host, only the steps those reads need from a call's
inputs, before its first collective, and names the first guard that comes out otherwise: the bare program refuses the
call (an ``InputError`` naming the input and the model's line), the drop-in module traces again for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary



@dataclass(frozen=True)
class ValueRead:
    """One place where the traced code depended on an input's values."""
    what: str  # the op, e.g. "Tensor.tolist"
    inputs: tuple[str, ...]  # the forward arguments its value derives from
    where: str  # the model's source line

    def __str__(self) -> str:
        return f"{self.what} of {', '.join(self.inputs)} at {self.where}"


@dataclass(frozen=True)
class Slot:
    """A tensor of the tape: an input or a step's output."""
    index: int


@dataclass(frozen=True)
class Blank:
    """A tensor an op takes for its shape and dtype only (``zeros_like`` of a graph value): any values will do."""
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Step:
    func: Callable
    args: Any  # the op's arguments, tensors as Slot or Blank
    kwargs: Any
    outputs: tuple[int | None, ...]  # the slot of each leaf of its result (None: not a tensor)
    writes: bool  # an in-place op: a slice by slots cannot see what else it changes


class GuardTape:
    """The ops computed from a trace's inputs alone, in order, recorded while it is traced."""

    def __init__(self):
        self.steps: list[Step] = []
        self.inputs: dict[int, str] = {}  # slot -> the forward argument it holds
        self._slots = WeakIdKeyDictionary()  # traced tensor -> slot
        self._count = 0

    def input(self, tensor: torch.Tensor, name: str) -> None:
        self.inputs[self._new_slot(tensor)] = name

    def record(self, func, args, kwargs, result, writes: bool) -> int:
        """Write one op on the tape; its step number."""
        template = lambda value: self._template(value)  # noqa: E731
        # The arguments' slots first: an op may return its argument itself (``x.float()`` of a float tensor, ``.to``
        # its own dtype), which then takes a new slot that the step must not read.
        args, kwargs = pytree.tree_map(template, args), pytree.tree_map(template, kwargs)
        outputs = tuple(self._new_slot(leaf) if isinstance(leaf, torch.Tensor) else None
                        for leaf in pytree.tree_leaves(result))
        self.steps.append(Step(func, args, kwargs, outputs, writes))
        return len(self.steps) - 1

    def _new_slot(self, tensor: torch.Tensor) -> int:
        self._slots[tensor] = self._count
        self._count += 1
        return self._count - 1

    def _template(self, value):
        if isinstance(value, torch.Tensor):
            slot = self._slots.get(value)
            return Slot(slot) if slot is not None else Blank(tuple(value.shape), value.dtype)
        if isinstance(value, torch.device):  # replayed on the host
            return torch.device("cpu")
        return value


@dataclass(frozen=True)
class ValueGuard:
    read: ValueRead  # what the model read, of which inputs, at which line
    step: int  # the tape's step that read it
    expected: Any  # what it read when traced

    def describe(self) -> str:
        return f"{self.read} (traced: {_short(self.expected)})"


@dataclass
class Guards:
    """The guards of one trace and the tape steps they replay."""
    tape: GuardTape
    guards: list[ValueGuard]
    flat_index: dict[str, int]  # forward argument name -> its index among the flattened arguments
    _needed: list[int] = field(default_factory=list, init=False)

    def __post_init__(self):
        self._needed = _needed_steps(self.tape, [g.step for g in self.guards])

    @property
    def inputs(self) -> set[str]:
        """The forward arguments a guard's replay reads."""
        used = {s.index for i in self._needed for s in pytree.tree_leaves(self.tape.steps[i].args)
                + pytree.tree_leaves(self.tape.steps[i].kwargs) if isinstance(s, Slot)}
        return {name for slot, name in self.tape.inputs.items() if slot in used}

    def failed(self, flat: list) -> ValueGuard | None:
        """The first guard that comes out otherwise for a call's flattened arguments than when traced, or None."""
        try:
            results = self._replay(flat)
        except Exception:  # (inputs the model's code cannot take the same way: not the traced branch)
            return self.guards[0]
        for guard in self.guards:
            if not _same(results[guard.step], guard.expected):
                return guard
        return None

    def _replay(self, flat: list) -> dict[int, Any]:
        writes = any(self.tape.steps[i].writes for i in self._needed)
        env = {}
        for slot, name in self.tape.inputs.items():
            value = flat[self.flat_index[name]]
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu()
                env[slot] = value.clone() if writes else value  # (the caller's tensors are never written)
        results = {}
        get = lambda leaf: _materialize(leaf, env)  # noqa: E731
        with torch.no_grad():
            for i in self._needed:
                step = self.tape.steps[i]
                result = step.func(*pytree.tree_map(get, step.args), **pytree.tree_map(get, step.kwargs))
                for slot, leaf in zip(step.outputs, pytree.tree_leaves(result)):
                    if slot is not None:
                        env[slot] = leaf
                results[i] = result
        return results


def _materialize(leaf, env: dict):
    if isinstance(leaf, Slot):
        return env[leaf.index]
    if isinstance(leaf, Blank):
        return torch.zeros(leaf.shape, dtype=leaf.dtype)
    return leaf


def _needed_steps(tape: GuardTape, reads: list[int]) -> list[int]:
    """The steps the reads need, in order: their slice by slots, or every step up to the last read when an
    in-place op is among them (a write through a view changes tensors of other slots)."""
    if not reads:
        return []
    last = max(reads)
    if any(step.writes for step in tape.steps[: last + 1]):
        return list(range(last + 1))
    producer = {slot: i for i, step in enumerate(tape.steps[: last + 1]) for slot in step.outputs if slot is not None}
    needed, pending = set(), list(reads)
    while pending:
        i = pending.pop()
        if i in needed:
            continue
        needed.add(i)
        step = tape.steps[i]
        for leaf in pytree.tree_leaves((step.args, step.kwargs)):
            if isinstance(leaf, Slot) and leaf.index in producer:
                pending.append(producer[leaf.index])
    return sorted(needed)


def _same(got, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype and \
            bool(torch.equal(got, expected))
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and \
            all(_same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(expected) and got == expected


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
