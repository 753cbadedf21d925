"""Backends lower a rank's graph to something that runs. Each is ``lower(gm, example_inputs) -> callable``."""

from __future__ import annotations

from typing import Callable

from . import eager

BACKENDS: dict[str, Callable] = {"eager": eager.lower}


def get(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]
