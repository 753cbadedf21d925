"""A plan saved to a file applies to a fresh trace on any supported torch: ``tests/data/tiny_h3.plan.json`` was
saved under torch 2.13 and is applied here under the torch this suite runs on (the compatibility run uses 2.9), to
the same program as the plan derived afresh. Values are found by module, op and structure (``ValueKey``), never by
node names, which differ between torch versions' traces. When the planner's decisions change on purpose, save the
file again: ``python tests/test_saved_plans.py``."""

from __future__ import annotations

from pathlib import Path

import partitioner
from partitioner import Plan
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

SAVED = Path(__file__).parent / "data" / "tiny_h3.plan.json"
MESH = {"tp": 2, "ulysses": 2}


def test_a_plan_saved_under_another_torch_applies_to_this_trace():
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    derived = partitioner.partition(model, MESH, ((), inputs))
    applied = partitioner.partition(model, MESH, ((), inputs), plan=Plan.from_json(SAVED))
    assert applied.graph_module.code == derived.graph_module.code
    assert applied.collective_counts() == derived.collective_counts()


if __name__ == "__main__":
    partitioner.plan(tiny_h3(), MESH, ((), h3_inputs(TINY_H3))).to_json(SAVED)
    print(f"wrote {SAVED}")
