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
    possible = [r for r in result if r["error"] is None]
    assert [r["step_s"] for r in possible] == sorted(r["step_s"] for r in possible)
    impossible = {(r["tp"], r["ring"], r["ulysses"]): r["error"] for r in result if r["error"]}
    assert "4 attention heads cannot be spread over a tp degree of 8" in impossible[(8, 1, 1)]
    assert all(r["replicas"] * r["tp"] * r["ring"] * r["ulysses"] == 8 for r in result)


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
    assert result.returncode == 2 and "neither a known model" in result.stderr


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("512") == 512
