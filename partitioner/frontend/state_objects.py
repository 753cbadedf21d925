"""State objects as forward arguments. A key/value cache (GlmImage's ``GlmImageKVCache``, SanaWM-LTX2's refiner
cache, WanAnimate 2's) is a plain Python object holding tensors in its attributes, which torch.export cannot take.
``register_state_objects`` registers such a type as a pytree node of its attributes: its tensors become graph
inputs and its other attributes (a cache's mode, its sample counter) constants the trace is specialised on and
every call is compared with, like any constant argument.

A forward may also write into one (store this call's keys for later calls: WanAnimate 2's "extract" pass, SanaWM's
capture modes). Export traces on a copy rebuilt from the flattened inputs, so those writes would be lost and the
next call would read a cache the eager model would have filled: a silent wrong answer. ``returning_writes`` compares
each state argument before and after the traced forward and returns the tensors it wrote as extra graph outputs
(``StateWrite`` says where each leaf of the written object comes from); ``write_back`` puts the written object into
the caller's after every call, in place, so the caller holds what the eager forward would have left.

What cannot be rebuilt faithfully is refused by name before anything is registered: an object reached twice (two
layers sharing one cache: rebuilt, they would be two) or from itself (a cycle), an attribute export cannot take (a
function, a lock, a class), a write into a tuple (it cannot be written in place)."""

from __future__ import annotations

import enum
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import InvariantError, TraceError

_OURS: set[type] = set()  # the types registered here (a registered dataclass or ModelOutput is not ours)
_NOT_STATE = (dict, list, tuple, set, frozenset, torch.nn.Module, torch.Tensor, type, types.ModuleType,
              functools.partial, enum.Enum, torch.Generator)


def is_state_object(value) -> bool:
    """A plain Python object whose attributes hold its state: not a container (a dict subclass keeps its items
    outside its attribute dict), module, tensor, class, function, enum or C object (no ``__dict__``)."""
    return (type(value) in _OURS or (hasattr(value, "__dict__") and type(value) not in pytree.SUPPORTED_NODES
                                     and not isinstance(value, _NOT_STATE) and not callable(value)))


def _children(value) -> list[tuple[str, Any]]:
    """A node's children with their key (``.keys``, ``[0]``, ``['name']``); none for a leaf."""
    if is_state_object(value):
        return [(f".{name}", child) for name, child in vars(value).items()]
    if pytree.tree_is_leaf(value):
        return []
    children = pytree.tree_flatten_with_path(value, is_leaf=lambda node: node is not value)[0]
    return [(pytree.keystr(path), child) for path, child in children]


def register_state_objects(named: dict, plain: Callable[[Any], bool], owner: str) -> list[str]:
    """Register the types of the state objects among the arguments, once every one of them is known to rebuild
    faithfully (no shared object, no cycle, every leaf it holds one export takes: ``plain``); return the names of
    the arguments that hold one."""
    found, seen, holders = set(), set(), set()

    def walk(value, argument: str, where: str, inside: str | None, stack: tuple):
        if is_state_object(value) or isinstance(value, (list, dict)):
            if id(value) in stack:
                raise TraceError(f"{owner}: argument {where} refers back to an object that holds it (a cycle), which "
                                 "a traced call cannot take apart; pass the state it needs without the cycle")
            if is_state_object(value) and id(value) in seen:
                raise TraceError(f"{owner}: argument {where} is an object the call reaches twice (a "
                                 f"{type(value).__qualname__}); a traced call takes its arguments apart and would "
                                 "rebuild it as two (writes into one lost to the other): pass each once")
            seen.add(id(value))
            stack += (id(value),)
        if is_state_object(value):
            found.add(type(value))
            holders.add(argument)
            inside = inside or f"{where} (a {type(value).__module__}.{type(value).__qualname__})"
        children = _children(value)
        if not children and inside is not None and pytree.tree_is_leaf(value) and not plain(value) \
                and not is_state_object(value):
            raise TraceError(
                f"{owner}: argument {inside} holds at {where} a {type(value).__module__}.{type(value).__qualname__},"
                " which torch.export cannot take as an input; a cache or other state object: call without it (None, "
                "or use_cache=False where the forward offers it) to partition the uncached forward")
        for key, child in children:
            walk(child, argument, where + key, inside, stack)

    for name, value in named.items():
        walk(value, name, name, None, ())
    for cls in found - _OURS:
        _register(cls)
    return [name for name in named if name in holders]


def _register(cls: type) -> None:
    def flatten(obj):
        state = vars(obj)
        return list(state.values()), tuple(state)

    def flatten_with_keys(obj):
        values, names = flatten(obj)
        return [(pytree.GetAttrKey(name), value) for name, value in zip(names, values)], names

    def unflatten(values, names):
        obj = cls.__new__(cls)  # (not __init__: its arguments are unknown, and the attributes are all here)
        vars(obj).update(zip(names, values))
        return obj

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
                                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    _OURS.add(cls)


class LeafKind(enum.Enum):
    OUTPUT = "output"  # one of the written tensors the graph returns (its index among them)
    INPUT = "input"  # kept as it was: the object's leaf at this index before the call
    CONSTANT = "constant"  # a non-tensor value the traced forward set


@dataclass(frozen=True)
class StateWrite:
    """A state argument the forward writes: its name, its structure after the call, and each leaf's source
    (``LeafKind``, and the index or value it takes)."""
    name: str
    spec: pytree.TreeSpec
    sources: tuple[tuple[LeafKind, Any], ...]


def _same(after, before) -> bool:
    return after is before or (not isinstance(after, torch.Tensor) and type(after) is type(before) and after == before)


def returning_writes(forward, names: list[str], writes: list[StateWrite], owner: str):
    """``forward`` that, when it writes into the state arguments ``names``, records each write in ``writes`` and
    returns ``(output, written tensors)``; unchanged, it returns the output alone."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        writes.clear()  # (what the last run of the trace wrote)
        before = {name: pytree.tree_flatten(kwargs[name]) for name in names if name in kwargs}
        copies = {name: pytree.tree_map(lambda leaf: leaf, kwargs[name]) for name in before}  # (as it was)
        out = forward(*args, **kwargs)
        written = []
        for name, (leaves, spec) in before.items():
            after, after_spec = pytree.tree_flatten(kwargs[name])
            if after_spec == spec and all(_same(a, b) for a, b in zip(after, leaves)):
                continue
            if _merged(copies[name], kwargs[name]) is not copies[name]:
                raise TraceError(f"{owner}.forward writes into argument {name!r} where it cannot be written back in "
                                 f"place (an element of a {type(kwargs[name]).__name__} replaced); pass a list")
            sources = []
            for leaf in after:
                kept = next((i for i, old in enumerate(leaves) if leaf is old), None)
                if not isinstance(leaf, torch.Tensor):
                    sources.append((LeafKind.CONSTANT, leaf))
                elif kept is not None:
                    sources.append((LeafKind.INPUT, kept))
                else:
                    sources.append((LeafKind.OUTPUT, len(written)))
                    written.append(leaf)
            writes.append(StateWrite(name, after_spec, tuple(sources)))
        return (out, written) if writes else out

    return wrapped


def write_back(named: dict, writes: tuple[StateWrite, ...], written: list[torch.Tensor]) -> None:
    """Put what the traced forward wrote into the call's own state objects (``named``: the call's arguments)."""
    for write in writes:
        target = named[write.name]
        current = pytree.tree_leaves(target)
        leaves = []
        for kind, value in write.sources:
            leaves.append(written[value] if kind is LeafKind.OUTPUT else current[value] if kind is LeafKind.INPUT
                          else value)
        if _merged(target, pytree.tree_unflatten(leaves, write.spec)) is not target:
            raise InvariantError(f"argument {write.name!r} could not be written in place (checked when traced)")


def written_tensors(named: dict, writes: tuple[StateWrite, ...]) -> list[torch.Tensor]:
    """The tensors an eager call left in its state arguments where the traced forward returns them (in the graph's
    order): the reference ``verify`` compares the written outputs with."""
    tensors = []
    for write in writes:
        leaves, spec = pytree.tree_flatten(named[write.name])
        if spec != write.spec:
            raise InvariantError(f"the eager call left argument {write.name!r} as {spec}, the trace as {write.spec}")
        tensors += [leaf for leaf, (kind, _) in zip(leaves, write.sources) if kind is LeafKind.OUTPUT]
    return tensors


def _merged(old, new):
    """``new``'s contents in ``old`` where ``old`` can hold them in place (a list, dict or state object: the
    caller's references into it stay valid); an immutable node (a tuple) is kept where its children all could be,
    else ``new``; a leaf is ``new``."""
    if type(old) is not type(new) or pytree.tree_is_leaf(old):
        return new
    if type(old) in _OURS:
        for name in [name for name in vars(old) if name not in vars(new)]:
            delattr(old, name)
        for name, value in vars(new).items():
            setattr(old, name, _merged(getattr(old, name, None), value))
        return old
    if isinstance(old, list):
        old[:] = [_merged(a, b) for a, b in zip(old, new)] + new[len(old):]
        return old
    if isinstance(old, dict):
        for key in [key for key in old if key not in new]:
            del old[key]
        for key, value in new.items():
            old[key] = _merged(old.get(key), value)
        return old
    node = pytree.SUPPORTED_NODES[pytree._get_node_type(old)]
    (old_children, old_context), (new_children, new_context) = node.flatten_fn(old), node.flatten_fn(new)
    if old_context != new_context or len(old_children) != len(new_children):
        return new
    merged = [_merged(a, b) for a, b in zip(old_children, new_children)]
    return old if all(m is a for m, a in zip(merged, old_children)) else node.unflatten_fn(merged, new_context)
