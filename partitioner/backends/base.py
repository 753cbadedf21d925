"""The one interface every backend implements, and the registry that finds it by name.

A backend is a lowering. It takes one of two graphs:

- "rank": this rank's program (after ``insert_collectives`` and ``localize``: explicit collectives, local shapes),
  run by one process per rank (eager, Inductor, Neuron);
- "global": the planned graph (before any collective, every value's placements attached) when one process drives
  every device and the backend partitions the program itself (XLA SPMD).

``lower(graph, *, mesh, collectives, **options)`` returns a callable that takes the graph's inputs positionally
(``collectives``: the plan's collective counts, for a backend that checks what it was given against them). The
callable may carry ``check_inputs(*inputs)``, which the runtime calls before a call's first collective (so that a
refusal is agreed by every rank), and ``stats``. ``check(graph, mesh, **options)`` runs the backend's legality rules
on any machine and returns the graph it checked (``partition(..., backend_checks=...)``). ``train(graph,
**options)``, where a backend has it, lowers the training copy of a rank program (``passes.differentiate``), whose
backward autograd records; a backend without it refuses ``backward`` by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import InputError, InvariantError, NotFound, did_you_mean

TAKES = ("rank", "global")


@dataclass(frozen=True)
class Backend:
    name: str
    takes: str  # "rank" or "global"
    lower: Callable
    options: tuple[str, ...] = ()  # the keyword options ``lower`` takes
    check: Callable | None = None  # offline legality rules
    train: Callable | None = None  # (training_graph, **options) -> callable; None: the backend runs inference only

    def validate(self, options: dict) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise InputError(f"backend {self.name!r} takes the options {list(self.options)}, not {unknown}")


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.takes not in TAKES:
        raise InvariantError(f"backend {backend.name!r}: takes must be one of {TAKES}")
    BACKENDS[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    if name not in BACKENDS:
        raise NotFound(f"unknown backend {name!r}{did_you_mean(name, BACKENDS)}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]


def with_checks() -> list[str]:
    return sorted(name for name, backend in BACKENDS.items() if backend.check is not None)
