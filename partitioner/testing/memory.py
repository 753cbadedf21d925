"""Measured memory: the most bytes the CPU allocator held at once during a call, from the profiler's allocation
events (``torch.profiler`` with ``profile_memory``). It counts what the call allocates (activations, kernel
temporaries, collective buffers), not what was allocated before it (weights, inputs)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(call: Callable[[], object]) -> int:
    """Peak bytes allocated and not yet freed while ``call()`` runs (its result included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    del result
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def traced_peak_bytes(model: torch.nn.Module, inputs: dict) -> int:
    """The peak of one call of ``model``'s traced single-device graph (what partitions are compared with: a graph
    frees each value after its last use, while eager Python keeps a forward's locals alive until it returns)."""
    from ..frontend.trace import trace

    traced = trace(model, ((), inputs))
    values = list(inputs.values())
    args = [traced.state[gi.target] if gi.kind != "user" else values[gi.target] for gi in traced.inputs]
    with torch.no_grad():
        traced.graph_module(*args)
        return peak_allocated_bytes(lambda: traced.graph_module(*args))


__all__ = ["peak_allocated_bytes", "traced_peak_bytes"]
