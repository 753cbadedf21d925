"""Backends lower a rank's graph to something that runs. Each is ``lower(gm, *, mesh, **options) -> callable``
taking the graph's inputs positionally (``mesh`` for backends whose rules depend on it, such as Neuron's).
``xla`` is the exception: it takes the global planned graph, not a rank's (see ``Partitioned.compile``)."""

from __future__ import annotations

from typing import Callable

from . import eager, inductor, neuron, xla

BACKENDS: dict[str, Callable] = {"eager": eager.lower, "inductor": inductor.lower, "neuron": neuron.lower,
                               "xla": xla.lower}


def get(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]
