"""Deciding and applying as separate steps: a Plan is made, saved, read, edited and applied."""

from __future__ import annotations

import pytest

import partitioner
from partitioner import MeshError, PartitionError, Plan
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

MESH = {"tp": 2, "ulysses": 2}


@pytest.fixture(scope="module")
def h3():
    return tiny_h3(), h3_inputs(TINY_H3)


def test_a_plan_round_trips_through_json_and_reproduces_the_partition(h3, tmp_path):
    model, inputs = h3
    plan = partitioner.plan(model, MESH, ((), inputs))
    assert plan.linears["transformer_blocks.0.ff.net.0.proj"].startswith("colwise packed")
    assert plan.sequence_seeds and plan.attention
    plan.to_json(tmp_path / "plan.json")
    read = Plan.from_json(tmp_path / "plan.json")
    assert read == plan and read.fingerprint == plan.fingerprint
    derived = partitioner.partition(model, MESH, ((), inputs))
    applied = partitioner.partition(model, MESH, ((), inputs), plan=read)
    assert applied.linear_styles == derived.linear_styles
    assert applied.collective_counts() == derived.collective_counts()
    assert applied.graph_module.code == derived.graph_module.code


def test_a_ring_x_ulysses_plan_keeps_each_axis_seeds(h3):
    """With two sequence axes the plan records each axis's seeds and applying it reproduces the program."""
    model, inputs = h3
    mesh = {"ring": 2, "ulysses": 2}
    plan = Plan.from_json(partitioner.plan(model, mesh, ((), inputs)).to_json())
    assert set(plan.sequence_seeds_by_axis) == {"ring", "ulysses"}
    derived = partitioner.partition(model, mesh, ((), inputs))
    applied = partitioner.partition(model, mesh, ((), inputs), plan=plan)
    assert applied.graph_module.code == derived.graph_module.code


def test_an_uneven_plan_round_trips(h3):
    """TP=3 on 4 heads: styles with uneven units read back and reproduce the same program."""
    model, inputs = h3
    plan = Plan.from_json(partitioner.plan(model, {"tp": 3}, ((), inputs)).to_json())
    assert plan.linears["transformer_blocks.0.attn.to_q"] == "colwise uneven 16-32 in units of 16"
    derived = partitioner.partition(model, {"tp": 3}, ((), inputs))
    applied = partitioner.partition(model, {"tp": 3}, ((), inputs), plan=plan)
    assert applied.linear_styles == derived.linear_styles
    assert applied.graph_module.code == derived.graph_module.code


def test_an_edited_plan_is_applied_as_edited(h3):
    model, inputs = h3
    plan = partitioner.plan(model, {"tp": 2}, ((), inputs))
    block0 = [p for p in plan.linears if p.startswith("transformer_blocks.0.attn.")]
    assert len(block0) >= 4
    plan.linears.update({path: "replicate" for path in block0})  # keep block 0's attention whole
    applied = partitioner.partition(model, {"tp": 2}, ((), inputs), plan=plan)
    assert all(applied.linear_styles[path] == "replicate" for path in block0)
    others = {p: s for p, s in plan.linears.items() if p not in block0}
    assert {p: applied.linear_styles[p] for p in others} == others  # the rest as planned
    # An edit that contradicts itself is still applied exactly: a forced column shard is gathered where it must be.
    plan.linears["transformer_blocks.1.attn.to_out.0"] = "replicate"
    contradicted = partitioner.partition(model, {"tp": 2}, ((), inputs), plan=plan)
    assert contradicted.linear_styles["transformer_blocks.1.attn.to_q"] == "colwise gathered"


def test_a_plan_for_another_mesh_or_model_is_refused(h3):
    model, inputs = h3
    plan = partitioner.plan(model, MESH, ((), inputs))
    with pytest.raises(MeshError, match=r"made for the mesh \{'tp': 2, 'ulysses': 2\}, not \{'tp': 4\}"):
        partitioner.partition(model, {"tp": 4}, ((), inputs), plan=plan)
    plan.sequence_seeds["no_such_value"] = 1
    with pytest.raises(PartitionError, match=r"does not have: \['no_such_value'\]"):
        partitioner.partition(model, MESH, ((), inputs), plan=plan)


def test_a_bad_style_in_a_plan_names_the_entry(h3):
    model, inputs = h3
    plan = partitioner.plan(model, {"tp": 2}, ((), inputs))
    plan.linears["proj_in"] = "diagonal"
    with pytest.raises(partitioner.InputError, match=r"'proj_in': style 'diagonal'"):
        partitioner.partition(model, {"tp": 2}, ((), inputs), plan=plan)


def test_sequence_seeds_that_cannot_apply_name_the_entry(h3):
    model, inputs = h3
    plan = partitioner.plan(model, MESH, ((), inputs))
    seed = next(iter(plan.sequence_seeds))
    plan.sequence_seeds[seed] = 9
    with pytest.raises(PartitionError, match=rf"sequence seed '{seed}': dim 9, which the value \(shape \["):
        partitioner.partition(model, MESH, ((), inputs), plan=plan)
    plan = partitioner.plan(model, MESH, ((), inputs))
    plan.sequence_seeds_by_axis = {"ring": dict(plan.sequence_seeds)}
    with pytest.raises(PartitionError, match=r"names mesh axes \['ring'\] that the mesh"):
        partitioner.partition(model, MESH, ((), inputs), plan=plan)


def test_a_plan_entry_whose_units_cannot_apply_is_refused_naming_it(h3):
    model, inputs = h3
    plan = partitioner.plan(model, {"tp": 2}, ((), inputs))
    path = next(p for p, style in plan.linears.items() if style == "colwise")
    plan.linears[path] = "colwise in units of 7"
    with pytest.raises(PartitionError, match=rf"plan entry '{path}': colwise in the plan's units or blocks cannot be"):
        partitioner.partition(model, {"tp": 2}, ((), inputs), plan=plan)
