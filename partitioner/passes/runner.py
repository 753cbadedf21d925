"""``run_passes``: what every pass needs done around it, written once.

For each pass: its requirements are checked against the passes already run; the pass runs; the graph is linted and
recompiled; the pass's postcondition is checked; every value that got a placement on an axis for the first time
records the pass (``meta["placed_by"]``, which ``Partitioned.verify`` names); the pass is timed
(``ctx.pass_seconds``) and logged on the ``partitioner`` logger; and the graph is dumped when dumps are on.
"""

from __future__ import annotations

import logging
import time

from torch.fx import GraphModule

from ..errors import InvariantError, our_step, where_it_failed  # noqa: F401 (where_it_failed: re-exported)

log = logging.getLogger("partitioner")


def run_passes(gm: GraphModule, ctx, passes, dump) -> GraphModule:
    for step in passes:
        missing = [name for name in step.requires if name not in ctx.pass_seconds]
        if missing:
            raise InvariantError(f"pass {step.name} requires {missing} to have run first")
        start = time.perf_counter()
        with our_step(f"pass {step.name}"):  # a bug of ours: say where, never a raw builtin from inside a pass
            gm = step.run(gm, ctx)
            gm.graph.lint()
            gm.recompile()
            step.check(gm, ctx)
        _record_placed_by(gm, step.name)
        ctx.pass_seconds[step.name] = time.perf_counter() - start
        log.info("%s: %.2f s, %d nodes", step.name, ctx.pass_seconds[step.name], len(gm.graph.nodes))
        extra = {"prologue": ctx.host.prologue} if step.name == "hoist_host" and ctx.host else None
        dump(step.name, gm, ctx, extra)
    return gm


def _record_placed_by(gm: GraphModule, pass_name: str) -> None:
    """Remember which pass first gave each value its placement on each axis."""
    for node in gm.graph.nodes:
        placed_by = node.meta.setdefault("placed_by", {})
        for axis in node.meta.get("placements", {}):
            placed_by.setdefault(axis, pass_name)
