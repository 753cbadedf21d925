"""Rows sharded over tp between the tensor-parallel regions (``plan_tp_sequence``): exact on real gloo ranks, the
structure it promises, and the cost rule that decides it.

Tolerance: as in test_tp_numerics (float32, atol = rtol = 1e-5). A reduce-scatter sums each row over the same
ranks an all_reduce does, and a norm, a residual add or a modulation computed on a slice of the rows gives those
rows' values, so the sharded program differs from the plain one by nothing but what tensor parallelism itself
reorders. The negative control replaces one reduce-scatter with this rank's rows unsummed and misses by more than
1e-3.
"""

from __future__ import annotations

import json

import pytest
import torch

from partitioner.runtime import collectives
from partitioner.testing import TINY_H3, fake_mesh, h3_inputs, run_ranks, tiny_h3
from partitioner.annotations import annotation

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
ROWS = dict(text=16, video=224, audio=16)
BLOCK_NORMS = ("transformer_blocks.1.norm1", "transformer_blocks.1.norm2")  # (not its q/k norms, on heads)
UNEVEN_ROWS = dict(text=15, video=223, audio=17)  # 255 packed rows, 15 text rows: 128 + 127 and 8 + 7 per rank


def _profile(directory, name: str, **figures) -> str:
    from partitioner.planning.cost import load_profile

    path = directory / f"{name}.json"
    path.write_text(json.dumps(dict(vars(load_profile("cpu-gloo")), name=name, **figures)))
    return str(path)


@pytest.fixture(scope="module")
def free_links(tmp_path_factory) -> str:
    """Communication that costs nothing: any repeated work saved pays, so the rows are always sharded."""
    return _profile(tmp_path_factory.mktemp("profile"), "free-links", local_gbps=1e9, link_gbps=1e9, latency_us=0.0,
                    overlap=0.0)


@pytest.fixture(scope="module")
def slow_messages(tmp_path_factory) -> str:
    """A millisecond per message: the extra all_gathers never pay."""
    return _profile(tmp_path_factory.mktemp("profile"), "slow-messages", latency_us=1000.0)


def _unsummed(x, dim, sizes, group_name):
    """A reduce_scatter that forgets to sum: this rank's rows of its own partial sum, front dim first as the wait
    takes them."""
    index = torch.distributed.get_rank(torch.distributed.distributed_c10d._resolve_process_group(group_name))
    return x.narrow(dim, sum(sizes[:index]), sizes[index]).movedim(dim, 0)


def _kinds(partitioned) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for node in partitioned.graph_module.graph.nodes:
        if annotation(node).collective is not None:
            kinds[annotation(node).collective[0]] = kinds.get(annotation(node).collective[0], 0) + 1
    return kinds


def _case(rank: int, world: int, axes: tuple[str, ...], profile: str, backend: str, rows: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    mesh = init_device_mesh("cpu", (2,) * len(axes), mesh_dim_names=axes)
    model, inputs = tiny_h3(), h3_inputs(TINY_H3, **rows)
    with torch.no_grad():
        expected = model(**inputs).sample
    errors, kinds = {}, {}
    for name, tp_sequence in (("on", True), ("off", False)):
        partitioned = partitioner.partition(model, mesh, ((), inputs),
                                            overlap={"profile": profile, "tp_sequence": tp_sequence})
        with torch.no_grad():
            errors[name] = float((partitioned.compile(backend)(**inputs).sample - expected).abs().max())
        kinds[name] = _kinds(partitioned)
        if tp_sequence and backend == "eager":  # every value this rank computes, against the model's rows
            partitioned.verify(**inputs)
    broken = partitioner.partition(model, mesh, ((), inputs), overlap={"profile": profile})
    scatter = next(n for n in broken.graph_module.graph.nodes if n.target is collectives.reduce_scatter_start
                   and "transformer_blocks.0" in str(n.meta.get("nn_module_stack")))
    scatter.target = _unsummed
    broken.graph_module.recompile()
    with torch.no_grad():
        errors["one reduce_scatter unsummed"] = float((broken.compile()(**inputs).sample - expected).abs().max())
    return dict(errors=errors, kinds=kinds, scale=float(expected.abs().max()))


@pytest.mark.parametrize("axes,backend,rows", [
    (("tp",), "inductor", ROWS), (("tp",), "eager", UNEVEN_ROWS), (("tp", "ulysses"), "eager", UNEVEN_ROWS),
    (("tp", "ring"), "eager", ROWS),
], ids=["tp2-inductor", "tp2-eager-uneven-rows", "tp2xu2-eager-uneven-rows", "tp2xring2-eager"])
def test_rows_sharded_between_tp_regions_are_exact(axes, backend, rows, free_links):
    for result in run_ranks(2 ** len(axes), _case, axes, free_links, backend, rows):
        errors, kinds = result["errors"], result["kinds"]
        bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * result["scale"]
        assert errors["on"] <= bound and errors["off"] <= bound, errors
        assert errors["one reduce_scatter unsummed"] > 1e-3, errors
        assert kinds["on"].get("reduce_scatter", 0) >= 4 and "reduce_scatter" not in kinds["off"], kinds
        # a reduce-scatter takes an all_reduce's place (the row-parallel projections of both blocks at least)
        assert kinds["off"]["all_reduce"] - kinds["on"]["all_reduce"] == kinds["on"]["reduce_scatter"], kinds


def _partition(overlap, axes=("tp",), shape=(2,), rows=ROWS):
    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3, **rows)
    with fake_mesh(shape, axes, 0) as mesh:
        return partitioner.partition(model, mesh, ((), inputs), overlap=overlap)


def test_norms_and_residuals_run_on_this_ranks_rows(free_links):
    """Between the regions a block's norm and residual add hold 1/tp of the packed rows; the rows are gathered once
    before the attention's q/k/v projections (one all_gather for the three) and reduce-scattered after its output
    projection."""
    from partitioner.placement import Shard

    partitioned = _partition({"profile": free_links})
    planned = partitioned.planned_graph.graph.nodes
    norms = [n for n in planned if n.target is torch.ops.aten.rms_norm.default
             and list(n.meta["nn_module_stack"].values())[-1][0] in BLOCK_NORMS]
    assert len(norms) == 2 and all(annotation(n).placements["tp"] == Shard(1) for n in norms)
    nodes = list(partitioned.graph_module.graph.nodes)
    gathers = [n for n in nodes if n.target is collectives.all_gather_wait]
    q = next(n for n in nodes if n.target is torch.ops.aten.linear.default
             and "transformer_blocks.1.attn.to_q" in str(n.meta["nn_module_stack"]))
    k = next(n for n in nodes if n.target is torch.ops.aten.linear.default
             and "transformer_blocks.1.attn.to_k" in str(n.meta["nn_module_stack"]))
    assert q.args[0] is k.args[0] and q.args[0] in gathers  # the same gathered rows feed q and k
    local = [n for n in partitioned.graph_module.graph.nodes if n.target is torch.ops.aten.rms_norm.default
             and list(n.meta["nn_module_stack"].values())[-1][0] in BLOCK_NORMS]
    assert len(local) == 2 and all(n.meta["val"].shape[1] == 128 for n in local)
    assert "reduce-scattered along dim 1" in partitioned.explain("transformer_blocks.1.attn.to_out.0")
    assert "between the tp regions: rows sharded over tp: 6 partial sums reduce-scattered" in partitioned.explain()


def test_the_cost_rule_keeps_rows_whole_where_gathers_cost_more(slow_messages):
    partitioned = _partition({"profile": slow_messages})
    assert "reduce_scatter" not in _kinds(partitioned)
    explained = partitioned.explain()
    assert "rows whole on every tp rank: the cost model estimates" in explained and "slow-messages" in explained


def test_switched_off_rows_stay_whole_and_explain_says_so(free_links):
    partitioned = _partition({"profile": free_links, "tp_sequence": False})
    assert "reduce_scatter" not in _kinds(partitioned)
    assert "switched off" in partitioned.ctx.tp_sequence and "switched off" in partitioned.explain()


def test_with_ulysses_tp_rows_nest_inside_its_shards(free_links):
    """TP=2 x Ulysses=2: Ulysses splits the 256 packed rows first, tp splits each of its shards (an InnerShard):
    64 rows per rank between the regions, gathered over tp back to Ulysses' 128 before q/k/v."""
    from partitioner.placement import InnerShard

    partitioned = _partition({"profile": free_links}, ("tp", "ulysses"), (2, 2))
    planned = [n for n in partitioned.planned_graph.graph.nodes if n.target is torch.ops.aten.rms_norm.default
               and list(n.meta["nn_module_stack"].values())[-1][0] in BLOCK_NORMS]
    assert len(planned) == 2 and all(annotation(n).placements["tp"] == InnerShard(1) for n in planned)
    local = [n for n in partitioned.graph_module.graph.nodes if n.target is torch.ops.aten.rms_norm.default
             and list(n.meta["nn_module_stack"].values())[-1][0] in BLOCK_NORMS]
    assert len(local) == 2 and all(n.meta["val"].shape[1] == 64 for n in local)
    q = next(n for n in partitioned.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default
             and "transformer_blocks.1.attn.to_q" in str(n.meta["nn_module_stack"]))
    assert q.args[0].target is collectives.all_gather_wait and q.args[0].meta["val"].shape[1] == 128


def test_xla_global_program_keeps_rows_whole_and_rank_programs_on_axis_sizes_do_not(free_links):
    """XLA's global program, asked for by name, keeps the plan XLA is handed unchanged; axis sizes plan rank
    programs, as a DeviceMesh partition would: rows sharded where it pays."""
    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3, **ROWS)
    partitioned = partitioner.partition(model, {"tp": 2}, ((), inputs), overlap={"profile": free_links},
                                        programs="global")
    assert "XLA's global program" in partitioned.ctx.tp_sequence
    ranked = partitioner.partition(model, {"tp": 2}, ((), inputs), overlap={"profile": free_links})
    assert ranked.ctx.tp_sequence.startswith("rows sharded over tp"), ranked.ctx.tp_sequence


def test_a_reduce_scatter_is_sized_by_what_it_sums(free_links):
    """The report sizes a reduce-scatter by its input, the bytes the all_reduce it replaces sums, and the cost
    model charges it the profile's share of that all_reduce: half on a ring (trn2, assumed), all of it on gloo
    (measured: gloo's reduce-scatter takes as long as its all-reduce)."""
    from partitioner.planning.cost import collective_s, load_profile
    from partitioner.planning.report import collective_calls

    def output_projection_sum(partitioned, target):
        return next(n for n in partitioned.graph_module.graph.nodes if n.target is target
                    and "transformer_blocks.1.attn.to_out" in str(n.meta.get("nn_module_stack")))

    scattered = output_projection_sum(_partition({"profile": free_links}), collectives.reduce_scatter_start)
    reduced = output_projection_sum(_partition({"profile": free_links, "tp_sequence": False}),
                                    torch.ops._c10d_functional.all_reduce.default)
    size = collective_calls(scattered)[0]
    assert size == collective_calls(reduced)[0] == 256 * 48 * 4
    group = list(range(8))
    for name, share in (("trn2", 0.5), ("cpu-gloo", 1.0)):
        profile = load_profile(name)
        assert collective_s("reduce_scatter", size, group, [group], profile) == \
            pytest.approx(share * collective_s("all_reduce", size, group, [group], profile))


def test_rows_another_axis_splits_are_not_reshaped_for_tp_alone(free_links):
    """Wan's output is unpatchified by a view that splits its rows into frames x height x width. Under TP=2 x
    Ulysses=2 tp's rows nest inside Ulysses' shard, so the view's split, judged for tp alone, is not this rank's:
    the rows are gathered before it (without the check, localize fails on the view's sizes)."""
    import partitioner
    from partitioner.testing.zoo import build, inputs

    model, (args, kwargs) = build("wan"), inputs("wan")
    with fake_mesh((2, 2), ("tp", "ulysses"), 3) as mesh:
        partitioned = partitioner.partition(model, mesh, (args, kwargs), overlap={"profile": free_links})
    assert "rows sharded over tp" in partitioned.ctx.tp_sequence and _kinds(partitioned)["reduce_scatter"] > 0
