"""Tracing must leave the user's model as it found it. A forward that caches on its first call (Z-Image's rotary
embedder sets ``self.freqs_cis`` to a list of tables the first time it runs) would otherwise keep what it computed
while torch.export traced it, from fake or meta tensors: the model, called eagerly afterwards, returns other
numbers than before it was partitioned, with no error. ``attributes_kept`` restores every module's plain attributes
(added, replaced, or a list or dict changed in place) once the trace is done; parameters, buffers and submodules
are not plain attributes (their own context managers put back what they swap). Plain Python objects a module holds
(a rotary helper) are restored alike, one level deep, and their classes' method caches emptied."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

_MISSING = object()
_TORCH_STATE = frozenset(vars(torch.nn.Module()))  # a module's own bookkeeping (hooks, parameters, ...): not ours
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _public(name: str) -> bool:
    """Names a model's own code sets. Private ones a library may set once with effects beyond the attribute
    (transformers records that it installed its output-capturing hooks so: deleting the record installs them
    twice); a private attribute the forward replaces is still restored."""
    return not name.startswith("_")


def _changed(value, content) -> bool:
    """A list, dict or set no longer holding what it held (the same objects, in order)."""
    if isinstance(value, dict):
        return value.keys() != content.keys() or any(value[key] is not content[key] for key in content)
    if isinstance(value, set):
        return value != content
    return len(value) != len(content) or any(a is not b for a, b in zip(value, content))


def _helpers(module: torch.nn.Module) -> list:
    """Plain Python objects a module holds as attributes (Z-Image's ``RopeEmbedder``), whose own attributes a
    forward may set: not modules, tensors, classes, functions or Python modules."""
    return [value for name, value in vars(module).items() if not name.startswith("_") and hasattr(value, "__dict__")
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, functools.partial))
            and not inspect.isroutine(value)]


def _clear_method_caches(classes: set[type]) -> None:
    """Empty the ``functools.lru_cache``/``cache`` of the classes' methods (QwenImage's and NucleusMoE's rotary
    ``_compute_video_freqs``): what they hold from the trace are fake tensors, which a later call or trace would
    take for real ones."""
    for cls in classes:
        for klass in cls.__mro__:
            for value in vars(klass).values():
                function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                while function is not None:  # (through decorators above the cache: functools.wraps keeps it)
                    if callable(getattr(function, "cache_clear", None)) and hasattr(function, "cache_info"):
                        function.cache_clear()
                    function = getattr(function, "__wrapped__", None)


@contextlib.contextmanager
def attributes_kept(model: torch.nn.Module):
    saved = []
    for owner in [*model.modules(), *(helper for module in model.modules() for helper in _helpers(module))]:
        attributes = dict(vars(owner))
        # lists and dicts by content: a cache filled in place, and a module's registries (a buffer registered or
        # replaced by the forward, a name that became a parameter)
        contents = {name: type(value)(value) for name, value in attributes.items()
                    if type(value) in (list, dict, set) and (_public(name) or name in _REGISTRIES)}
        saved.append((owner, attributes, contents))
    try:
        yield
    finally:
        _clear_method_caches({type(owner) for owner, _, _ in saved})
        for module, attributes, contents in saved:
            current = vars(module)
            for name in [name for name in current if name not in attributes and _public(name)]:
                del current[name]
            for name, value in attributes.items():
                if name not in _TORCH_STATE and current.get(name, _MISSING) is not value:
                    current[name] = value
            for name, content in contents.items():  # (a cache filled in place)
                value = current[name]
                if _changed(value, content):
                    value.clear()
                    (value.update if isinstance(value, (dict, set)) else value.extend)(content)
