"""The deployment planner: `python -m partitioner report`, on full-size H3 and on a tiny config."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import pytest

from partitioner.planning.planner import layouts, parse_bytes
from partitioner.testing import TINY_H3

CLI = [sys.executable, "-m", "partitioner", "report"]


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_full_size_h3_on_meta_in_seconds_and_little_memory():
    """Full H3 (50 blocks, 37888 packed rows, bfloat16 with its float32 modules) traced and partitioned for
    TP=8 x Ulysses=4 on meta weights: seconds, well under 2 GiB, and the figures of a real deployment."""
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = run_cli("--model", "minimax-h3", "--mesh", "tp=8,ulysses=4", "--seq-len", "37888",
                     "--device-memory", "24GiB", "--json")
    seconds = time.perf_counter() - start
    peak_kib = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    assert seconds < 120 and peak_kib < 2 * 2**20, (seconds, peak_kib)
    (layout,) = json.loads(result.stdout)
    assert (layout["tp"], layout["ulysses"], layout["fits"]) == (8, 4, True)
    # ~33B parameters over 8: bfloat16 bulk about 7.7 GiB, the float32 modules a few MiB
    assert 7.5 * 2**30 < layout["parameter_bytes"]["bfloat16"] < 8 * 2**30
    assert 0 < layout["parameter_bytes"]["float32"] < 2**30
    assert set(layout["collective_bytes"]) == {"all_reduce", "all_to_all", "all_gather"}
    assert layout["compute_s"] > layout["comm_s"] > 0
    # each rank builds only its rows of the packed sequence: 0.67 GiB (1.52 GiB when it was built whole; TP=8
    # alone: 1.55 GiB)
    assert layout["activation_bytes"] < 0.75 * 2**30


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from diffusers import MiniMaxH3Transformer3DModel

    path = tmp_path_factory.mktemp("config")
    MiniMaxH3Transformer3DModel.from_config(TINY_H3).save_config(path)
    return path


def test_uneven_tp_report_states_every_rank(tiny_config):
    """tp=3 on 4 heads: the JSON states rank 0's parameter count and the largest and smallest rank, and the
    memory that must fit is the largest rank's; the text names both ranks."""
    (layout,) = json.loads(run_cli("--config", str(tiny_config), "--mesh", "tp=3", "--seq-len", "64",
                                   "--json").stdout)
    largest, smallest = layout["parameter_ranks"]["largest"], layout["parameter_ranks"]["smallest"]
    assert largest["rank"] == 0 and smallest["rank"] == 2 and largest["bytes"] > smallest["bytes"]
    assert layout["parameter_count"] == largest["parameter_count"]
    assert layout["memory_bytes"] == largest["bytes"] + layout["activation_bytes"]
    text = run_cli("--config", str(tiny_config), "--mesh", "tp=3", "--seq-len", "64").stdout
    assert "largest rank 0:" in text and "smallest rank 2:" in text


def test_config_file_report(tiny_config):
    """A diffusers config folder works like a model name; the human-readable report names every figure."""
    text = run_cli("--config", str(tiny_config), "--mesh", "tp=2,ulysses=2", "--seq-len", "64",
                   "--device-memory", "1MiB").stdout
    for words in ("layout tp=2 x ulysses=2", "parameters bfloat16", "parameters float32", "activation peak",
                  "all_to_all", "all_reduce", "step estimate", "needs"):
        assert words in text


def test_search_ranks_layouts(tiny_config):
    """--search lists every layout of the devices: possible ones first, fastest first among those that fit, and
    impossible ones with the reason."""
    result = json.loads(run_cli("--config", str(tiny_config), "--search", "--devices", "8", "--seq-len", "64",
                                "--json").stdout)
    assert {(r["tp"], r["ring"], r["ulysses"]) for r in result} == set(layouts(8))
    assert len(result) == 20 and (2, 2, 2) in set(layouts(8)) and len(layouts(8, ring=False)) == 10
    possible = [r for r in result if r["error"] is None and r["pruned"] is None]
    assert [r["step_s"] for r in possible] == sorted(r["step_s"] for r in possible)
    impossible = {(r["tp"], r["ring"], r["ulysses"]): r["error"] for r in result if r["error"]}
    assert "4 attention heads cannot be spread over a tp degree of 8" in impossible[(8, 1, 1)]
    assert all(r["replicas"] * r["tp"] * r["ring"] * r["ulysses"] == 8 for r in result)


def _meta_h3(layers: int):
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from partitioner.frontend.trace import trace
    from partitioner.planning import planner

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config({**TINY_H3, "num_layers": layers})
    model = planner.apply_dtype(model.eval(), torch.bfloat16)
    return trace(model, planner.example_inputs(model, 64))


def test_search_costs_cuts_of_the_repeated_blocks_as_whole_partitions(monkeypatch):
    """The search costs a layout from the trace cut to 2 and 3 of its 5 blocks: every figure equals the whole
    partition's (sizes exactly, times to rounding), at every layout of 8 devices, on a device where compute
    outweighs communication and on one where communication backs up; it never partitions the whole trace; pruned
    layouts are bounded below by what they cost, and the best layout is the exhaustive search's."""
    from partitioner.planning import cost, planner
    from partitioner.planning.extrapolate import cut_chain, extrapolated

    traced = _meta_h3(5)
    # a slow device: compute outweighs communication, as at production sizes, so that few ranks can be pruned
    slow = cost.with_overrides(cost.load_profile("trn2"), matmul_tflops=1e-3, memory_gbps=1.0)
    (two, blocks), (three, _) = cut_chain(traced, 2), cut_chain(traced, 3)
    cuts = two, three
    assert blocks == 5
    assert [len(cut.inputs) for cut in cuts] < [len(traced.inputs)] * 2
    whole = {}
    for profile, ring_too in ((cost.load_profile("trn2"), False), (slow, True)):
        for tp, ring, ulysses in layouts(8, ring=ring_too):
            full = planner.estimate(traced, "h3", tp, ulysses, 8, profile, ring=ring)
            whole[tp, ring, ulysses] = full
            cut = extrapolated(*(planner.estimate(c, "h3", tp, ulysses, 8, profile, ring=ring) for c in cuts), 5)
            assert (cut.error is None) == (full.error is None), (tp, ring, ulysses, cut.error, full.error)
            if full.error:
                continue
            a, b = full.as_dict(), cut.as_dict()
            for key in ("parameter_bytes", "parameter_count", "parameter_ranks", "ranks", "activation_bytes",
                        "collective_bytes", "memory_bytes"):
                assert a[key] == b[key], (tp, ring, ulysses, key)
            for key in ("flops", "compute_s", "comm_s", "exposed_comm_s", "step_s"):
                assert b[key] == pytest.approx(a[key], rel=1e-9), (tp, ring, ulysses, key)
            assert b["comm_s_by_kind"] == pytest.approx(a["comm_s_by_kind"], rel=1e-9)
    sizes, estimate = [], planner.estimate
    monkeypatch.setattr(planner, "estimate", lambda t, *a, **k: sizes.append(len(t.graph_module.graph.nodes))
                        or estimate(t, *a, **k))
    found = planner.search(traced, "h3", 8, slow, workers=1)
    assert max(sizes) < len(traced.graph_module.graph.nodes)  # never the whole trace
    assert found[0].extrapolated_from == 5 and found[0].step_s == pytest.approx(
        min(e.step_s for e in whole.values() if not e.error), rel=1e-4)
    pruned = [e for e in found if e.pruned]
    assert pruned, "a layout of 1 or 2 ranks should be pruned by the 8-rank ones"
    for e in pruned:  # the bound a layout is pruned by is never above what it costs
        assert e.step_s <= whole[e.tp, e.ring, e.ulysses].step_s * (1 + 1e-9)
    assert {(e.tp, e.ring, e.ulysses) for e in found} == set(whole)


def test_a_layout_the_partitioner_fails_on_does_not_end_the_search(monkeypatch):
    """An internal failure at one layout (an InvariantError: a bug) is listed with that layout, loudly, and every
    other layout is still costed."""
    from partitioner.errors import InvariantError
    from partitioner.planning import planner

    traced, estimate = _meta_h3(2), planner.estimate

    def failing(t, name, tp, ulysses, *args, ring=1, **kwargs):
        if (tp, ring, ulysses) == (2, 1, 1):
            raise InvariantError("pass localize failed at view_3")
        return estimate(t, name, tp, ulysses, *args, ring=ring, **kwargs)

    monkeypatch.setattr(planner, "estimate", failing)
    found = {(e.tp, e.ring, e.ulysses): e for e in planner.search(traced, "h3", 4, workers=1, ring=False)}
    assert set(found) == set(layouts(4, ring=False))
    assert found[2, 1, 1].error == "the partitioner failed (a bug): pass localize failed at view_3"
    assert found[1, 1, 1].error is None and found[4, 1, 1].error is None


def test_a_cut_runs_as_the_model_with_fewer_blocks():
    """The cut is the model with its first blocks only (values checked), and a model that reads every block's
    output is not cut (the search partitions it whole)."""
    import torch

    from partitioner.frontend.trace import trace
    from partitioner.planning.extrapolate import cut_chain

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, h):
            return torch.nn.functional.gelu(self.linear(h)) + h

    class Chain(torch.nn.Module):
        def __init__(self, collect: bool):
            super().__init__()
            self.proj_in = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(5))
            self.proj_out, self.collect = torch.nn.Linear(16, 4), collect

        def forward(self, x, first: int = 5):
            h, seen = self.proj_in(x), []
            for block in self.blocks[:first]:
                h = block(h)
                seen.append(h)
            return self.proj_out(torch.stack(seen).sum(0) if self.collect else h)

    torch.manual_seed(0)
    model, x = Chain(collect=False).eval(), torch.randn(3, 8)
    traced = trace(model, ((x,), {}))
    for keep in (1, 2):
        cut, blocks = cut_chain(traced, keep)
        assert blocks == 5
        args = [cut.state[gi.target] if gi.is_model_tensor else x for gi in cut.inputs]
        (out,) = cut.graph_module(*args)
        torch.testing.assert_close(out, model(x, first=keep), rtol=0, atol=0)
        assert sum(gi.is_model_tensor for gi in cut.inputs) == 4 + 2 * keep
    assert cut_chain(trace(Chain(collect=True).eval(), ((x,), {})), 1) is None


def test_ring_layouts_are_costed(tiny_config):
    """A ring splits the attention work as Ulysses does (each rank: its query rows over every key, the same FLOPs),
    moves its key/value blocks as ring passes instead of all_to_all, and its activations fall with the degree (the
    estimate counts the blocks in flight, the float32 partial results and, planned on meta weights for a device
    other than the CPU, the chunked float32 scores of each block: this tiny model's attention dominates it); a ring
    longer than every sequence is impossible, with the reason."""
    from partitioner.planning import planner
    from partitioner.frontend.trace import trace

    model = planner.build_meta_model(str(tiny_config))
    traced = {seq_len: trace(model, planner.example_inputs(model, seq_len)) for seq_len in (16, 64, 4096)}

    def report(mesh: str, seq_len: int = 64) -> dict:
        sizes = {axis: int(size) for axis, size in (part.split("=") for part in mesh.split(","))}
        return planner.estimate(traced[seq_len], type(model).__name__, sizes.get("tp", 1), sizes.get("ulysses", 1),
                                ring=sizes.get("ring", 1)).as_dict()

    ring, ulysses, whole = report("ring=2"), report("ulysses=2"), report("tp=1")
    assert ring["ring"] == 2 and ring["replicas"] == 1
    assert ring["flops"] == pytest.approx(ulysses["flops"], rel=1e-6) and ring["flops"] < 0.6 * whole["flops"]
    assert set(ring["collective_bytes"]) == {"ring_pass", "all_gather"} and ring["comm_s"] > 0
    activations = {mesh: report(mesh, 4096)["activation_bytes"] for mesh in ("ring=2", "ring=4")}
    assert activations["ring=4"] < 0.6 * activations["ring=2"]
    assert "a ring of 64 shards no attention" in report("ring=64", seq_len=16)["error"]
    text = run_cli("--config", str(tiny_config), "--mesh", "tp=2,ring=2,ulysses=2", "--seq-len", "64").stdout
    assert "layout tp=2 x ring=2 x ulysses=2" in text and "ring_pass" in text


def test_json_states_every_rank_and_html_shows_the_plan(tiny_config, tmp_path):
    """--json: every rank's parameters, the largest rank's figures, compute and communication time (all of it and
    the exposed part, per kind) on the chosen profile; --html writes the picture of the same layout."""
    page = tmp_path / "plan.html"
    result = run_cli("--config", str(tiny_config), "--mesh", "tp=3,ulysses=2", "--seq-len", "64", "--json",
                     "--profile", "h100-nvlink", "--html", str(page))
    (layout,) = json.loads(result.stdout)
    assert layout["profile"] == "h100-nvlink" and layout["layout"] == "tp=3 x ulysses=2"
    # 4 heads over tp=3: tp rank 0 (ranks 0 and 1, ulysses peers) holds two heads, the others one (and tp rank 2
    # a narrower feed-forward slice)
    counts = [r["parameter_count"] for r in layout["ranks"]]
    assert [r["rank"] for r in layout["ranks"]] == list(range(6))
    assert counts[0] == counts[1] > counts[2] == counts[3] > counts[4] == counts[5]
    assert layout["largest_rank"]["rank"] == layout["parameter_ranks"]["largest"]["rank"] == 0
    assert layout["largest_rank"]["parameter_count"] == layout["parameter_count"]
    assert 0 < layout["exposed_comm_s"] <= layout["comm_s"] and layout["compute_s"] > 0
    assert set(layout["comm_s_by_kind"]) == set(layout["collective_bytes"]) == {"all_reduce", "all_to_all",
                                                                               "all_gather"}
    assert layout["fits"] is True  # the profile's 80 GB when --device-memory is not given
    html = page.read_text()
    assert 'data-block="transformer_blocks.0"' in html and "exposed" in html


def test_bad_arguments_are_clear(tiny_config):
    result = run_cli("--config", str(tiny_config), "--mesh", "pp=2", "--seq-len", "64", check=False)
    assert result.returncode == 2 and "unknown mesh dim names ['pp']" in result.stderr
    result = run_cli("--config", str(tiny_config / "absent.json"), "--seq-len", "64", check=False)
    assert result.returncode == 2 and "is neither a JSON file" in result.stderr


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("512") == 512
