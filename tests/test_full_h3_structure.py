"""Full-size MiniMax-H3 (50 blocks, 56 heads x 128, meta weights) partitioned for rank 3 of TP=8 on PyTorch's fake
process group: what that rank would run, checked without running it."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest
import torch

from partitioner.runtime import collectives
from partitioner.testing import fake_mesh, full_h3_on_meta

TP = 8
RANK = 3
aten = torch.ops.aten
functional = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def full_h3():
    import partitioner

    model, inputs = full_h3_on_meta()
    with fake_mesh((TP,), ("tp",), RANK) as mesh:
        start = time.perf_counter()
        partitioned = partitioner.partition(model, mesh, ((), inputs), overlap={"profile": "trn2"})
        yield model, partitioned, mesh, time.perf_counter() - start


def _module_of(node) -> str:
    return list(node.meta["nn_module_stack"].values())[-1][0]


def test_partition_is_fast(full_h3):
    """Tracing and partitioning 33B parameters on meta takes seconds, not minutes (generous bound for CI)."""
    assert full_h3[3] < 120


def _sums(partitioned) -> list:
    """The nodes that sum partial results over tp: all_reduces, and reduce-scatters where plan_tp_sequence shards
    the rows between the tp regions (on trn2, this fixture's profile, it pays for full-size H3)."""
    return [n for n in partitioned.graph_module.graph.nodes
            if n.target in (functional.all_reduce.default, collectives.reduce_scatter_start)]


def test_all_reduces_per_block(full_h3):
    """3 sums per transformer block: AdaLN table (row-wise on its input dim), attention output projection,
    feed-forward down projection. 2 per refiner block (no AdaLN). Outside the blocks: the timestep MLP's second
    linear, the text embedder (row-wise: 512 rows against 5120 features), and the two output heads (row-wise after
    the column-sharded modulation of norm_out). Nothing else sums; the rows between the regions are
    reduce-scattered after both output projections of a block and gathered before its q/k/v and feed-forward."""
    model, partitioned, mesh, _ = full_h3
    per_module = Counter(_module_of(n) for n in _sums(partitioned))
    per_block = Counter(re.sub(r"^transformer_blocks\.\d+\.", "", m) for m in per_module
                        if m.startswith("transformer_blocks."))
    assert per_block == {"adaln_proj.linear": 50, "attn.to_out.0": 50, "ff.net.2": 50}
    per_refiner = Counter(re.sub(r"^token_refiner\.refiner_blocks\.\d+\.", "", m) for m in per_module
                          if m.startswith("token_refiner."))
    assert per_refiner == {"attn.to_out.0": 2, "ff.net.2": 2}
    outside = {m for m in per_module if not m.startswith(("transformer_blocks.", "token_refiner."))}
    assert outside == {"time_embedder.linear_2", "context_embedder", "proj_out", "audio_proj_out"}
    assert all(count == 1 for count in per_module.values())
    report = partitioned.report()
    assert report.count("all_reduce") + report.count("reduce_scatter") == 3 * 50 + 2 * 2 + 4
    scattered = Counter(re.sub(r"^transformer_blocks\.\d+\.", "", _module_of(n)) for n in _sums(partitioned)
                        if n.target is collectives.reduce_scatter_start and _module_of(n).startswith("transformer_blocks."))
    assert scattered == {"attn.to_out.0": 50, "ff.net.2": 50}, partitioned.ctx.tp_sequence
    group = mesh.get_group("tp").group_name
    assert all(n.args[-1] == group for n in _sums(partitioned))


def test_every_block_linear_sharded_as_planned(full_h3):
    """q/k/v column-wise, output projection row-wise, the fused SwiGLU [value; gate] column-wise with each half
    split on its own, the down projection row-wise, the AdaLN table row-wise."""
    _, partitioned, _, _ = full_h3
    expected = {"attn.to_q": "colwise", "attn.to_k": "colwise", "attn.to_v": "colwise", "attn.to_out.0": "rowwise",
                "ff.net.0.proj": "colwise packed [14336, 14336]", "ff.net.2": "rowwise",
                "adaln_proj.linear": "rowwise"}
    for block in range(50):
        for name, style in expected.items():
            assert partitioned.linear_styles[f"transformer_blocks.{block}.{name}"] == style
    for block in range(2):
        for name, style in expected.items():
            if name != "adaln_proj.linear":
                assert partitioned.linear_styles[f"token_refiner.refiner_blocks.{block}.{name}"] == style
    spec = partitioned.slice_specs["transformer_blocks.7.ff.net.0.proj.weight"]["tp"]
    assert (spec.dim, spec.blocks) == (0, (14336, 14336))
    assert partitioned.slice_specs["transformer_blocks.7.adaln_proj.linear.weight"]["tp"].dim == 1
    assert "transformer_blocks.7.adaln_proj.linear.bias" not in partitioned.slice_specs  # added once, after the sum


def test_heads_reshape_by_head_dim(full_h3):
    """Each rank holds 56 / 8 = 7 heads of 128 channels, reshaped by head_dim."""
    _, partitioned, _, _ = full_h3
    splits = [n for n in partitioned.graph_module.graph.nodes if n.target is aten.unflatten.int]
    assert len(splits) == 3 * (50 + 2)
    for node in splits:
        assert list(node.args[2]) == [-1, 128]
        assert tuple(node.meta["val"].shape[-2:]) == (7, 128)
    for node in partitioned.graph_module.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            assert node.meta["val"].shape[1] == 7


def test_parameter_count_equals_slicing_specs(full_h3):
    """Per-rank parameters are what the slicing specs imply, computed from the model's own parameter shapes."""
    model, partitioned, _, _ = full_h3
    implied = 0
    for name, param in model.named_parameters():
        spec = partitioned.slice_specs.get(name, {})
        implied += param.numel() // (TP if spec else 1)
    assert partitioned.report().parameters == implied
    held = sum(t.numel() for name, t in partitioned.state.items() if name in dict(model.named_parameters()))
    assert held == implied
    total = sum(p.numel() for p in model.parameters())
    assert 32e9 < total < 34e9 and implied < total / 7  # nearly everything is sharded
