"""Deciding and applying as separate steps: a Plan is made, saved, read, edited and applied."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import partitioner
from partitioner import InputError, MeshError, PartitionError, Plan
from partitioner.decisions import LinearSharding, Style
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

MESH = {"tp": 2, "ulysses": 2}


@pytest.fixture(scope="module")
def h3():
    return tiny_h3(), h3_inputs(TINY_H3)


def test_a_plan_round_trips_through_json_and_reproduces_the_partition(h3, tmp_path):
    model, inputs = h3
    plan = partitioner.plan(model, MESH, ((), inputs))
    packed = plan.linears["transformer_blocks.0.ff.net.0.proj"]
    assert packed.style is Style.COLWISE and packed.blocks and str(packed).startswith("colwise packed")
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
    assert set(plan.sequence_seeds) == {"ring", "ulysses"} and all(plan.sequence_seeds.values())
    derived = partitioner.partition(model, mesh, ((), inputs))
    applied = partitioner.partition(model, mesh, ((), inputs), plan=plan)
    assert applied.graph_module.code == derived.graph_module.code


def test_an_uneven_plan_round_trips(h3):
    """TP=3 on 4 heads: styles with uneven units read back and reproduce the same program."""
    model, inputs = h3
    plan = Plan.from_json(partitioner.plan(model, {"tp": 3}, ((), inputs)).to_json())
    assert str(plan.linears["transformer_blocks.0.attn.to_q"]) == "colwise uneven 16-32 in units of 16"
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
    others = {p: str(s) for p, s in plan.linears.items() if p not in block0}
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
    first, *rest = plan.sequence_seeds["ulysses"]
    moved = dataclasses.replace(first, key=dataclasses.replace(first.key, module="no.such.module"))
    plan.sequence_seeds["ulysses"] = (moved, *rest)
    with pytest.raises(PartitionError, match=r"sequence seeds over 'ulysses' name values this trace does not have: "
                                             r"[^;]* in no\.such\.module"):
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
    first, *rest = plan.sequence_seeds["ulysses"]
    plan.sequence_seeds["ulysses"] = (dataclasses.replace(first, dim=9), *rest)
    with pytest.raises(PartitionError, match=re.escape(f"sequence seed over 'ulysses' at {first.key}: dim 9, which "
                                                       "the value (shape [")):
        partitioner.partition(model, MESH, ((), inputs), plan=plan)
    plan = partitioner.plan(model, MESH, ((), inputs))
    plan.sequence_seeds = {"ring": plan.sequence_seeds["ulysses"]}
    with pytest.raises(PartitionError, match=r"name mesh axes \['ring'\] that the mesh"):
        partitioner.partition(model, MESH, ((), inputs), plan=plan)


def test_a_plan_entry_whose_units_cannot_apply_is_refused_naming_it(h3):
    model, inputs = h3
    plan = partitioner.plan(model, {"tp": 2}, ((), inputs))
    path = next(p for p, style in plan.linears.items() if str(style) == "colwise")
    plan.linears[path] = LinearSharding(Style.COLWISE, unit=7)
    with pytest.raises(PartitionError, match=rf"plan entry '{path}': colwise in the plan's units or blocks cannot be"):
        partitioner.partition(model, {"tp": 2}, ((), inputs), plan=plan)


def _scaled_first_block(model):
    """A forward pre-hook that adds one multiply before the first block: node names after it shift by one."""
    def scale(module, args, kwargs):
        if args:
            return (args[0] * 1.0, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 1.0}
    return model.transformer_blocks[0].register_forward_pre_hook(scale, with_kwargs=True)


def test_a_saved_plan_applies_to_a_retrace_with_an_op_added_and_names_what_it_cannot_place(h3):
    """Sequence seeds are keyed by module, op and structure, not by node names: a plan saved before a hook added a
    multiply before the first block applies to the retrace exactly as the retrace's own plan (with names, it was
    refused for a dim of another value, or landed on one). A model of another shape refuses the plan entry by name."""
    model, inputs = h3
    saved = Plan.from_json(partitioner.plan(model, MESH, ((), inputs)).to_json())
    handle = _scaled_first_block(model)
    try:
        derived = partitioner.partition(model, MESH, ((), inputs))
        applied = partitioner.partition(model, MESH, ((), inputs), plan=saved)
    finally:
        handle.remove()
    assert applied.graph_module.code == derived.graph_module.code
    assert applied.collective_counts() == derived.collective_counts()
    with pytest.raises(PartitionError, match=r"plan entry '[\w.]*ff\.net\.0\.proj': packed blocks "
                                             r"\[96, 96\] do not add up to the Linear's 256 output features"):
        partitioner.partition(tiny_h3(ffn_dim=128), MESH, ((), inputs), plan=saved)


def test_the_fingerprint_hashes_decisions_not_their_text(h3):
    """Rewording what explain() prints (the attention lines a plan carries read-only) leaves the fingerprint."""
    model, inputs = h3
    plan = partitioner.plan(model, MESH, ((), inputs))
    reworded = dataclasses.replace(plan, attention={path: "reworded" for path in plan.attention})
    assert reworded.fingerprint == plan.fingerprint
    data = json.loads(plan.to_json())
    assert set(data) == {"version", "mesh", "linears", "sequence_seeds", "bounds", "attention"}
    assert data["linears"]["transformer_blocks.0.attn.to_q"] == {"style": "colwise", "blocks": None, "unit": 1,
                                                                 "widths": [32, 32], "gathered": False}
    edited = dataclasses.replace(plan, linears={**plan.linears, "transformer_blocks.0.attn.to_q": "replicate"})
    assert edited.fingerprint != plan.fingerprint
    # what is derived again when applied (a Linear's widths) is not hashed: a style name edits to the same plan
    renamed = dataclasses.replace(plan, linears={**plan.linears, "transformer_blocks.0.attn.to_q": "colwise"})
    assert renamed.fingerprint == plan.fingerprint
    with pytest.raises(InputError, match="plan version 1 found its sequence seeds by fx node names"):
        Plan.from_json(json.dumps({**data, "version": 1}))


def test_hand_edited_seeds_and_linears_are_refused_by_name(h3):
    """A seed whose place is outside its values alike, or two seeds that land on one value, are refused naming the
    plan, never an IndexError or a seed silently dropped; a Linear edit that is not a decision is an InputError."""
    model, inputs = h3
    data = json.loads(partitioner.plan(model, MESH, ((), inputs)).to_json())
    seeds = data["sequence_seeds"]["ulysses"]
    for change, message in [({"twin": 7, "alike": 3}, "0 <= twin < alike"), ({"twin": -1}, "0 <= twin < alike"),
                            ({"depth": 10**6}, "depth of 0 to 12")]:
        edited = {**data, "sequence_seeds": {"ulysses": [{**seeds[0], **change}, *seeds[1:]]}}
        with pytest.raises(InputError, match=re.escape(message)):
            Plan.from_json(json.dumps(edited))
    edited = {**data, "sequence_seeds": {"ulysses": [*seeds, seeds[0]]}}  # one value twice
    with pytest.raises(PartitionError, match="find one value for several of their entries"):
        partitioner.partition(model, MESH, ((), inputs), plan=Plan.from_json(json.dumps(edited)))
    plan = Plan.from_json(json.dumps(data))
    for bad in (LinearSharding("diagonal"), LinearSharding(Style.COLWISE, blocks=96),
                LinearSharding(Style.COLWISE, unit="2"), LinearSharding(Style.COLWISE, blocks=(96, -96))):
        plan.linears["proj_in"] = bad
        with pytest.raises(InputError, match="plan entry 'proj_in'"):
            plan.to_json()


def test_a_shape_specialisation_keeps_the_plans_sequence_seeds(h3):
    """Keys name integer arguments (sizes) by kind: a plan applies to the same model at other input shapes, so a
    specialisation traces once and derives nothing again (with sizes in the keys it re-derived every seed)."""
    model, inputs = h3
    partitioned = partitioner.partition(model, MESH, ((), inputs))
    specialized = partitioned.specialize(((), h3_inputs(TINY_H3, video=16)))
    assert specialized.ctx.replanned == ""
    assert specialized.collective_counts() == partitioner.partition(
        model, MESH, ((), h3_inputs(TINY_H3, video=16))).collective_counts()


def test_keys_name_ops_by_qualified_name_never_by_address():
    """A plain function target prints its address (``<function sym_float at 0x..>``): it would differ per process
    and rank, and so would every key and fingerprint downstream of it."""
    from partitioner.passes.value_keys import op_name

    graph = torch.fx.Graph()
    node = graph.call_function(torch.sym_float, (graph.placeholder("n"),))
    assert op_name(node) == "torch.sym_float"
