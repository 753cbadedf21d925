"""Communication/computation overlap (chunk_reductions, schedule_collectives): exact on real gloo ranks with every
technique on and off, and the scheduled graph's structure.

Tolerance: as in test_tp_numerics (float32, atol = rtol = 1e-5). Chunking a row-parallel linear splits its rows,
never its reduction dim, and reordering independent nodes changes no arithmetic, so the overlapped program differs
from the plain one by nothing but what tensor parallelism itself reorders. The negative control drops one chunk's
all_reduce and misses by more than 1e-3.
"""

from __future__ import annotations

import json

import pytest
import torch

from partitioner.testing import TINY_H3, drop_all_reduce, h3_inputs, run_ranks, tiny_h3
from partitioner.annotations import annotation

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
ROWS = dict(text=16, video=224, audio=16)  # 256 packed rows: two chunks of 64 rows even on a Ulysses shard
VARIANTS = {"on": True, "off": False, "no chunks": {"chunk_reductions": False}, "no schedule": {"schedule": False}}
functional = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def slow_links(tmp_path_factory) -> str:
    """A device profile on which the tiny model's row-parallel matmuls and their all_reduces take about as long as
    each other (about 0.1 s each), where chunking pays most: every one with enough rows is chunked."""
    from partitioner.planning.cost import load_profile

    profile = dict(vars(load_profile("cpu-gloo")), name="slow-links", matmul_tflops=1e-5, local_gbps=5e-4,
                   link_gbps=5e-4, latency_us=0.0, overlap=1.0)
    path = tmp_path_factory.mktemp("profile") / "slow-links.json"
    path.write_text(json.dumps(profile))
    return str(path)


def _overlap(variant, profile: str | None) -> dict:
    options = {"chunk_reductions": variant, "schedule": variant, "tp_sequence": variant} if isinstance(variant, bool) \
        else dict(variant)
    return {**options, "profile": profile} if profile else options


def _cases(rank: int, world: int, axes: tuple[str, ...], profile: str, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    mesh = init_device_mesh("cpu", (2,) * len(axes), mesh_dim_names=axes)
    model, inputs = tiny_h3(), h3_inputs(TINY_H3, **ROWS)
    with torch.no_grad():
        expected = model(**inputs).sample
    errors, chunked = {}, {}
    for name, variant in VARIANTS.items():
        partitioned = partitioner.partition(model, mesh, ((), inputs), overlap=_overlap(variant, profile))
        with torch.no_grad():
            actual = partitioned.compile(backend)(**inputs).sample
        errors[name] = float((actual - expected).abs().max())
        chunked[name] = sum(1 for n in partitioned.graph_module.graph.nodes if n.target is functional.all_reduce.default)
    dropped = partitioner.partition(model, mesh, ((), inputs), overlap=_overlap(True, profile))
    drop_all_reduce(dropped, "transformer_blocks.1.ff.net.2")  # the first of its chunks' sums
    with torch.no_grad():
        errors["one chunk's all_reduce dropped"] = float((dropped.compile()(**inputs).sample - expected).abs().max())
    return dict(errors=errors, all_reduces=chunked, scale=float(expected.abs().max()))


@pytest.mark.parametrize("axes,backend", [(("tp",), "eager"), (("tp",), "inductor"), (("tp", "ulysses"), "eager")],
                         ids=["tp2-eager", "tp2-inductor", "tp2xu2-eager"])
def test_every_technique_is_exact(axes, backend, slow_links):
    for result in run_ranks(2 ** len(axes), _cases, axes, slow_links, backend):
        errors, scale = result["errors"], result["scale"]
        bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * scale
        for variant in VARIANTS:
            assert errors[variant] <= bound, (variant, errors)
        assert errors["one chunk's all_reduce dropped"] > 1e-3, errors
        counts = result["all_reduces"]
        assert counts["on"] > counts["off"] == counts["no chunks"], counts  # the slow links did chunk


def _graph(overlap, profile=None, mesh=None):
    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3, **ROWS)
    return partitioner.partition(model, mesh or {"tp": 2}, ((), inputs), overlap=_overlap(overlap, profile))


def _between(nodes: list, start, wait) -> list:
    return nodes[nodes.index(start) + 1:nodes.index(wait)]


def test_schedule_issues_early_and_waits_after_independent_compute(slow_links):
    """Each chunk's all_reduce is issued before the next chunk's matmul and waited on after it; the AdaLN
    projection's all_reduce is in flight while the block's first norm runs."""
    partitioned = _graph(True, slow_links)
    nodes = list(partitioned.graph_module.graph.nodes)
    reduces = [n for n in nodes if n.target is functional.all_reduce.default]
    ff = [n for n in reduces if "transformer_blocks.0.ff.net.2" in str(n.meta["nn_module_stack"])]
    assert len(ff) >= 2, "the slow-link profile chunks the FFN's down projection"
    assert any(n.target is torch.ops.aten.linear.default and n.args[0] is not ff[0].args[0].args[0]
               for n in _between(nodes, ff[0], next(iter(ff[0].users))))
    adaln = next(n for n in reduces if "transformer_blocks.0.adaln_proj" in str(n.meta["nn_module_stack"]))
    assert any(n.target is torch.ops.aten.rms_norm.default for n in _between(nodes, adaln, next(iter(adaln.users))))
    assert f"{len(ff)} chunks" in partitioned.explain("transformer_blocks.0.ff.net.2")


def test_without_overlap_every_wait_follows_its_collective():
    nodes = list(_graph(False).graph_module.graph.nodes)
    for node in nodes:
        if node.target is functional.all_reduce.default:
            assert nodes[nodes.index(node) + 1] is next(iter(node.users))


def test_schedule_keeps_the_collective_order():
    """Every rank must issue the same collectives in the same order: scheduling moves compute, never them."""
    from partitioner.passes.schedule_collectives import issues_collective

    def order(partitioned):
        return [n.name for n in partitioned.graph_module.graph.nodes if issues_collective(n)]

    mesh = {"tp": 2, "ulysses": 2}
    assert order(_graph({"chunk_reductions": False}, mesh=mesh)) == \
        order(_graph({"chunk_reductions": False, "schedule": False}, mesh=mesh))


@pytest.mark.parametrize("video,chunked", [(351, False), (354, True)], ids=["127-128-rows", "128-129-rows"])
def test_chunks_are_decided_alike_on_every_rank(slow_links, video, chunked):
    """Ulysses=3 gives ranks uneven rows (383 rows: 128, 128, 127; 386: 129, 129, 128) and TP=2 uneven heads'
    widths; the number of chunks (how many all_reduces a rank issues) must not depend on them: chunks keep 64 rows,
    so 127 rows on one rank means one chunk on every rank, 128 on every rank two."""
    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3, text=16, video=video, audio=16)
    counts = set()
    for rank in range(6):
        partitioned = partitioner.partition(model, {"tp": 2, "ulysses": 3}, ((), inputs), rank=rank,
                                            overlap={"profile": slow_links})
        counts.add(sum(1 for n in partitioned.graph_module.graph.nodes if n.target is functional.all_reduce.default))
    plain = partitioner.partition(model, {"tp": 2, "ulysses": 3}, ((), inputs), overlap=False)
    unchunked = sum(1 for n in plain.graph_module.graph.nodes if n.target is functional.all_reduce.default)
    assert len(counts) == 1, counts
    assert (counts.pop() > unchunked) == chunked


def test_ranks_agree_on_the_chunks(slow_links):
    """The plan the ranks compare names each row-parallel all_reduce's chunks: a profile file that differs
    between hosts (other chunks, other collectives) is a disagreement, not a hang."""
    from partitioner.build import compared_plan_lines

    lines = compared_plan_lines(_graph(True, slow_links), [])
    assert any(line.startswith("all_reduce of transformer_blocks.0.ff.net.2: ") and "chunks" in line for line in lines)
    assert not any(line.startswith("all_reduce of") for line in compared_plan_lines(_graph(False), []))
    chunked = [line.split(": ", 1)[1] for line in lines if line.startswith("all_reduce of")]
    assert all(how == "whole" or how.endswith(" chunks") and how != "1 chunks" for how in chunked), chunked


def test_bad_overlap_option_is_named():
    from partitioner.errors import InputError

    with pytest.raises(InputError, match="overlap="):
        _graph({"chunks": 4})


def _profile(path, **figures) -> str:
    from partitioner.planning.cost import load_profile

    with open(path) as f:
        profile = dict(json.load(f), **figures)
    out = path.replace(".json", "-" + "-".join(f"{k}{v}" for k, v in figures.items()) + ".json")
    with open(out, "w") as f:
        json.dump(profile, f)
    load_profile(out)  # (valid)
    return out


def test_nothing_moves_where_nothing_can_hide(slow_links):
    """On a profile whose collectives hide nothing behind compute (overlap 0) the rule neither chunks nor
    reorders: the graph is the one without overlap."""
    from partitioner.planning.dump import graph_code

    hidden_nothing = _profile(slow_links, overlap=0.0)
    assert graph_code(_graph(True, hidden_nothing).graph_module) == graph_code(_graph(False).graph_module)


def test_step_time_credits_the_schedule(slow_links):
    """The cost model reads the schedule: the compute between an all_reduce and its wait hides it, as far as the
    profile's overlap share says; with every wait right after its collective nothing is hidden."""
    from partitioner.planning.cost import load_profile, step_time

    overlapped, plain = _graph(True, slow_links), _graph(False)
    full, none = load_profile(slow_links), load_profile(_profile(slow_links, overlap=0.0))
    mesh = overlapped.ctx.mesh
    assert step_time(overlapped.graph_module, mesh, full).exposed_comm_s < \
        0.8 * step_time(overlapped.graph_module, mesh, none).exposed_comm_s
    assert step_time(plain.graph_module, mesh, full).exposed_comm_s == \
        pytest.approx(step_time(plain.graph_module, mesh, none).exposed_comm_s)
    assert step_time(overlapped.graph_module, mesh, full).step_s < step_time(plain.graph_module, mesh, full).step_s


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_an_issued_collective_waits_after_independent_compute(kind):
    """Each collective the graphs issue in two nodes (issue, then wait) is scheduled alike: the wait gives way to
    a matmul that does not need its result, while the collective's estimated time is not yet covered."""
    from partitioner.runtime import collectives
    from partitioner.passes.schedule_collectives import _order

    aten, graph = torch.ops.aten, torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    issue, wait = {
        "all_gather": (lambda: graph.call_function(collectives.all_gather_start, (x, 0, [4, 4], "tp")),
                       lambda issued: graph.call_function(collectives.all_gather_wait, (issued, 0, [4, 4]))),
        "reduce_scatter": (lambda: graph.call_function(collectives.reduce_scatter_start, (x, 0, [4, 4], "tp")),
                           lambda issued: graph.call_function(collectives.reduce_scatter_wait, (issued, 0, 4))),
        "all_reduce": (lambda: graph.call_function(functional.all_reduce.default, (x, "sum", "tp")),
                       lambda issued: graph.call_function(functional.wait_tensor.default, (issued,))),
    }[kind]
    issued = issue()
    annotation(issued).collective = (kind, "tp")
    done = wait(issued)
    independent = graph.call_function(aten.mm.default, (w, w))
    joined = graph.call_function(aten.add.Tensor, (done, independent))
    graph.output(joined)
    for node in graph.nodes:
        node.meta["val"] = torch.empty(8, 8)
    run = [issued, done, independent, joined]
    order = _order(run, compute_s=lambda n: 1.0 if n is independent else 0.0, comm_s=lambda n: 1.0, limit=1e12)
    assert order == [issued, independent, done, joined]
    # nothing to cover (a free collective): the original order stays
    assert _order(run, compute_s=lambda n: 1.0, comm_s=lambda n: 0.0, limit=1e12) == run


def test_ulysses_exchanges_of_q_k_and_v_are_in_flight_together(slow_links):
    """An attention's q, k and v exchanges (all_to_all) are issued before the first of them is waited on, so the
    later ones travel while the earlier ones arrive; the collective order is unchanged (checked by the pass). Their
    send buffers are held until the waits and overlap may not raise the block's peak: with a feed-forward 4x the
    hidden width, as in production DiTs, the peak is the feed-forward's and the exchanges fit under it (with the
    tiny model's 2x they do not, and stay one at a time)."""
    import partitioner
    from partitioner.runtime import collectives

    config = dict(TINY_H3, ffn_dim=4 * TINY_H3["hidden_size"])
    model, inputs = tiny_h3(ffn_dim=config["ffn_dim"]), h3_inputs(config, **ROWS)

    def graph(overlap):
        return partitioner.partition(model, {"ulysses": 2}, ((), inputs),
                                     overlap=_overlap(overlap, slow_links)).graph_module

    nodes = list(graph(True).graph.nodes)
    issued = [n for n in nodes if n.target is collectives.all_to_all_start
              and "transformer_blocks.0.attn" in str(n.meta["nn_module_stack"])]
    assert len(issued) == 4  # q, k, v, and the output back
    q, k, v, _ = issued
    (q_wait,) = q.users
    assert nodes.index(q) < nodes.index(k) < nodes.index(v) < nodes.index(q_wait)
    unscheduled = list(graph({"schedule": False}).graph.nodes)
    q = next(n for n in unscheduled if n.target is collectives.all_to_all_start)
    assert unscheduled[unscheduled.index(q) + 1] is next(iter(q.users))  # without the schedule: waited at once


def test_the_next_collective_s_inputs_are_computed_first():
    """Three projections, each exchanged (Ulysses' q, k and v): the query exchange is issued as soon as the query
    projection has run, and the key and value projections run while it travels (the original order computes all
    three first). A free collective (nothing to hide) keeps the original order."""
    from partitioner.runtime import collectives
    from partitioner.passes.schedule_collectives import _order

    aten, graph = torch.ops.aten, torch.fx.Graph()
    x, *weights = (graph.placeholder(name) for name in ("x", "wq", "wk", "wv"))
    products = [graph.call_function(aten.mm.default, (x, w)) for w in weights]
    projections = [graph.call_function(aten.mul.Tensor, (p, 2.0)) for p in products]  # (a norm, say)
    issued = []
    for projection in projections:
        issued.append(graph.call_function(collectives.all_to_all_start, (projection, 0, 1, "ulysses")))
        annotation(issued[-1]).collective = ("all_to_all", "ulysses")
    done = [graph.call_function(collectives.all_to_all_wait, (i,)) for i in issued]
    graph.output(graph.call_function(aten.cat.default, (done,)))
    for node in graph.nodes:
        node.meta["val"] = torch.empty(8, 8)
    run = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    order = _order(run, compute_s=lambda n: 1.0, comm_s=lambda n: 1.0, limit=1e12)
    assert order[:9] == [node for i in range(3) for node in (products[i], projections[i], issued[i])]
    assert _order(run, compute_s=lambda n: 1.0, comm_s=lambda n: 0.0, limit=1e12)[:4] == [*products, projections[0]]


def test_computing_the_next_collective_s_inputs_first_obeys_the_memory_bound():
    """The next collective's inputs go first only within the hoisting limits: a large value that feeds it, hoisted
    over an earlier exchange's wait, would outlive the original peak; it is pinned and the run still gets a schedule
    (was: every limit gave the same order, and the run kept its original order with no overlap at all)."""
    from partitioner.runtime import collectives
    from partitioner.passes.schedule_collectives import _within_memory, peak_bytes

    aten, graph = torch.ops.aten, torch.fx.Graph()
    x, w, xb, wb = (graph.placeholder(name) for name in ("x", "w", "xb", "wb"))
    first = graph.call_function(collectives.all_to_all_start, (graph.call_function(aten.mm.default, (x, w)), 0, 1, "u"))
    read = graph.call_function(aten.mul.Tensor, (graph.call_function(collectives.all_to_all_wait, (first,)), 2.0))
    big = graph.call_function(aten.mm.default, (xb, wb))
    second = graph.call_function(collectives.all_to_all_start,
                                 (graph.call_function(aten.sum.dim_IntList, (big, [0], True)), 0, 1, "u"))
    done = graph.call_function(collectives.all_to_all_wait, (second,))
    graph.output(graph.call_function(aten.cat.default, ([done, graph.call_function(aten.mul.Tensor, (read, 3.0))],)))
    for node in graph.nodes:
        node.meta["val"] = torch.empty(64, 64) if node is big else torch.empty(8, 8)
    for issued in (first, second):
        annotation(issued).collective = ("all_to_all", "u")
    run = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    order = _within_memory(run, compute_s=lambda n: 1.0, comm_s=lambda n: 1.0)
    assert order is not None and peak_bytes(order) <= peak_bytes(run)
    assert order != run  # still overlapped: the last multiply runs while the second exchange travels
