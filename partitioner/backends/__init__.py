"""Lowerings of a partition, one per file, each registered by name behind ``base.Backend``: ``eager`` (the rank's
GraphModule as it is), ``inductor`` (regional compilation), ``neuron`` (legalised and checked, then torch-neuronx),
``xla`` (XLA SPMD from the global plan). ``get(name)`` finds one."""

from __future__ import annotations

from . import eager, inductor, neuron, xla  # noqa: F401  (each registers itself)
from .base import BACKENDS, Backend, get, register, with_checks

__all__ = ["BACKENDS", "Backend", "get", "register", "with_checks"]
