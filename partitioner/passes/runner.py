"""``run_passes``: what every pass needs done around it, written once.

For each pass: its requirements are checked against the passes already run; the pass runs; the graph is linted;
the pass's postcondition is checked; every value that got a placement on an axis for the first time
records the pass (``annotation.placed_by``, which ``Partitioned.verify`` names); the pass is timed
(``ctx.pass_seconds``) and logged on the ``partitioner`` logger; and the graph is dumped when dumps are on.
The Python code of the graph is generated once, after the last pass: passes read and rewrite ``gm.graph`` and run it
through ``torch.fx.Interpreter`` (fake-tensor propagation), never through ``gm.forward``, and generating the code of
a 50-block graph costs about as much as a small pass (0.2-0.3 s each time).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

from torch.fx import GraphModule

from ..errors import InvariantError, our_step
from ..progress import bar
from ..annotations import annotation

log = logging.getLogger("partitioner")


def run_passes(gm: GraphModule, ctx, passes, dump) -> GraphModule:
    progress = bar(passes, desc="partitioning", unit="pass")
    for step in progress:
        progress.set_postfix_str(step.name, refresh=False)
        missing = [name for name in step.requires if name not in ctx.pass_seconds]
        if missing:
            raise InvariantError(f"pass {step.name} requires {missing} to have run first")
        start = time.perf_counter()
        with our_step(f"pass {step.name}"):  # a bug of ours: say where, never a raw builtin from inside a pass
            gm = step.run(gm, ctx)
            gm.graph.lint()
            step.check(gm, ctx)
        _record_placed_by(gm, step.name)
        ctx.pass_seconds[step.name] = time.perf_counter() - start
        log.info("%s: %.2f s, %d nodes", step.name, ctx.pass_seconds[step.name], len(gm.graph.nodes))
        extra = {"prologue": ctx.host.prologue} if step.name == "hoist_host" and ctx.host else None
        dump(step.name, gm, ctx, extra)
    gm.recompile()
    return gm


@contextlib.contextmanager
def collector_skips_what_exists():
    """Python's cyclic garbage collector walks every tracked object each time its oldest generation fills; with a
    50-block trace alive (fake tensors, nodes, their metadata) each walk takes 0.3-0.4 s, two or three times per
    partition. The objects alive when partitioning starts (the model, the trace) are moved out of its walks until
    it ends (``gc.freeze``); what the passes make and drop is still collected."""
    global _freezes
    if _freezes == 0:
        gc.freeze()
    _freezes += 1
    try:
        yield
    finally:
        _freezes -= 1
        if _freezes == 0:
            gc.unfreeze()


_freezes = 0  # (nested: partition's planning inside partition)


def _record_placed_by(gm: GraphModule, pass_name: str) -> None:
    """Remember which pass first gave each value its placement on each axis."""
    for node in gm.graph.nodes:
        noted = annotation(node)
        placed_by = noted.placed_by = noted.placed_by if noted.placed_by is not None else {}
        for axis in (annotation(node).placements or {}):
            placed_by.setdefault(axis, pass_name)
