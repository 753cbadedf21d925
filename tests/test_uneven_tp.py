"""Uneven tensor parallelism: tp degrees that divide neither the head count nor the widths. Heads split whole and
balanced (7 heads over 3 ranks: 3 + 2 + 2), other column shards to within one row, every rank exact.

Tolerance: as in test_tp_numerics (float32, only the order of additions changes; atol = rtol = 1e-5, 100x above
the measured ~5e-7). The negative control (one all_reduce dropped) misses by more than 1e-3.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import partitioner
from partitioner.runtime import collectives
from partitioner.placement import shard_sizes, slice_local
from partitioner.testing import (TINY_H3, drop_all_reduce, fake_mesh, flux_inputs, full_h3_on_meta, h3_inputs,
                                 run_ranks, tiny_flux, tiny_h3)

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
HEADS = 7  # 3, 5 and 7 ranks: 3+2+2, 2+2+1+1+1, 1 each
# 7 heads x 16 and an FFN of 206: neither 3 nor 5 divides any width (7 divides the heads only)
UNEVEN_H3 = dict(num_attention_heads=HEADS, hidden_size=16 * HEADS, time_embed_hidden_dim=16 * HEADS, ffn_dim=206)
aten = torch.ops.aten
functional = torch.ops._c10d_functional


def _h3():
    return tiny_h3(**UNEVEN_H3), h3_inputs({**TINY_H3, **UNEVEN_H3}, video=12, audio=7)


def _first(out):
    return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)


def _run(mesh, model, inputs, drop: str | None = None) -> dict:
    with torch.no_grad():
        expected = _first(model(**inputs))
    partitioned = partitioner.partition(model, mesh, ((), inputs))
    if drop:  # negative control: the all_reduce after ``drop``'s linear is bypassed
        drop_all_reduce(partitioned, drop)
    heads = [n.meta["val"].shape[1] for n in partitioned.graph_module.graph.nodes
             if n.target is aten.scaled_dot_product_attention.default]
    report = partitioned.report()
    return dict(expected=expected, actual=_first(partitioned.compile()(**inputs)), heads=heads,
                styles=partitioned.linear_styles, share=report.replicated_share, params=report.rank_parameters)


def _tp_cases(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cases = dict(h3=_run(mesh, *_h3()))
    if world < HEADS:
        cases["flux"] = _run(mesh, tiny_flux(heads=HEADS), flux_inputs())
    if world == 3:
        cases["dropped"] = _run(mesh, *_h3(), drop="transformer_blocks.1.attn.to_out.0")
    return cases


@pytest.mark.parametrize("world", [3, 5, 7])
def test_uneven_tp_every_rank_exact(world):
    """TP=3, 5, 7 on H3 and Flux with 7 heads (Flux at 3 and 5: at 7 its heads and widths divide): every rank
    exact; rank r holds shard_sizes(7, world)[r] heads in every attention. Replicated share of a rank's parameter
    bytes, measured: H3 6.0-6.9%, 9.1-11.4%, 13.6-14.4% at tp=3, 5, 7; Flux 2.7-3.0%, 4.3-5.2%. It grows with the
    degree because the replicated part (input embedders that end in a norm) is fixed while the rest shrinks."""
    results = run_ranks(world, _tp_cases)
    for rank, result in enumerate(results):
        for name in [name for name in ("h3", "flux") if name in result]:
            case = result[name]
            torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE, msg=f"{name} rank {rank}")
            assert set(case["heads"]) == {shard_sizes(HEADS, world)[rank]}, (name, rank, case["heads"])
            assert case["share"] < 0.20, (name, case["share"])
            assert case["styles"]["transformer_blocks.0.attn.to_q"].startswith("colwise")
    if world == 3:
        assert results[0]["h3"]["styles"]["transformer_blocks.0.attn.to_q"] == \
            "colwise uneven 32-48 in units of 16"
        assert results[0]["h3"]["styles"]["transformer_blocks.0.ff.net.0.proj"] == \
            "colwise packed [206, 206] uneven 136-138"
        for rank, result in enumerate(results):  # the negative control misses on every rank
            case = result["dropped"]
            assert (case["actual"] - case["expected"]).abs().max() > 1e-3, rank
    # every rank reports every rank's parameter count, and they agree with what each rank holds
    assert all(result["h3"]["params"] == results[0]["h3"]["params"] for result in results)


def _tp_ulysses(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (5, 2), mesh_dim_names=("tp", "ulysses"))
    return _run(mesh, *_h3())


def test_uneven_tp5_x_ulysses2_exact():
    """TP=5 x Ulysses=2: tp ranks hold 2, 2, 1, 1, 1 heads; Ulysses splits each rank's heads again inside its
    group (1 head over 2 ranks leaves one rank none, which is correct). Every rank exact."""
    for rank, result in enumerate(run_ranks(10, _tp_ulysses)):
        torch.testing.assert_close(result["actual"], result["expected"], **TOLERANCE, msg=f"rank {rank}")
        tp_heads = shard_sizes(HEADS, 5)[rank // 2]
        assert shard_sizes(tp_heads, 2)[rank % 2] in result["heads"], (rank, result["heads"])


@pytest.mark.parametrize("name", ["flux2", "sd3"])
def test_uneven_zoo_models_exact(name):
    """Zoo models at TP=3 (their heads and widths not divisible by 3): Flux2's single blocks slice a fused
    qkv + SwiGLU projection packed in five uneven blocks (each rank's block offsets differ); SD3 joins its
    attention streams. Every rank exact."""
    from partitioner.testing.zoo_check import partition_case

    for rank, result in enumerate(run_ranks(3, partition_case, name, (3,), ("tp",))):
        assert result["status"] == "exact", (name, rank, result)


def test_uneven_shards_load_from_a_checkpoint(tmp_path):
    """Shard-on-read at TP=3: every rank of a meta partition loads exactly its uneven slices of each tensor
    (heads whole), and holds the parameter count its report states for it."""
    from diffusers import MiniMaxH3Transformer3DModel

    model, inputs = _h3()
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    full = dict(model.state_dict())
    meta_inputs = {name: value.to("meta") for name, value in inputs.items()}
    for rank in range(3):
        with torch.device("meta"):
            meta = MiniMaxH3Transformer3DModel(**{**TINY_H3, **UNEVEN_H3}).eval()
        partitioned = partitioner.partition(meta, {"tp": 3}, ((), meta_inputs), rank=rank)
        partitioned.load_weights(tmp_path)
        for name, spec in partitioned.slice_specs.items():
            assert torch.equal(partitioned.state[name], slice_local(full[name], spec["tp"], 3, rank)), name
        q = partitioned.state["transformer_blocks.0.attn.to_q.weight"]
        assert q.shape[0] == 16 * shard_sizes(HEADS, 3)[rank]
        held = sum(partitioned.state[gi.target].numel() for gi in partitioned.ctx.inputs if gi.kind == "parameter")
        assert held == partitioned.report().rank_parameters[rank][0]


# --- full-size H3 at tp=16: 56 heads, 8 ranks with 4 and 8 with 3 -------------------------------------------------

@pytest.fixture(scope="module", params=[15])
def full_h3_tp16(request):
    from partitioner.planning.planner import apply_dtype

    model, inputs = full_h3_on_meta()
    model = apply_dtype(model, torch.bfloat16)  # as the real checkpoint: bf16, its keep-in-fp32 modules float32
    inputs = {name: value.to(torch.bfloat16) if value.is_floating_point() else value for name, value in inputs.items()}
    with fake_mesh((16,), ("tp",), request.param) as mesh:
        yield model, partitioner.partition(model, mesh, ((), inputs)), request.param


def test_full_h3_tp16(full_h3_tp16):
    """Full-size H3 at tp=16, planned for rank 15 (3 heads; ranks 0-7 hold 4): 3 heads of 128 in every attention,
    3 sums per block as at tp=8 (all_reduces, or reduce-scatters where the rows between the regions are sharded),
    every rank's parameters (the report states each) within 5% of total / 16 and, in bf16 with the activation
    estimate, the largest rank inside a 24 GiB core (4.0 GiB + 1.6 GiB)."""
    model, partitioned, rank = full_h3_tp16
    heads = 4 if rank < 8 else 3
    graph = partitioned.graph_module.graph
    for node in graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            assert tuple(node.meta["val"].shape[1:2]) + tuple(node.meta["val"].shape[3:]) == (heads, 128)
        if node.target is aten.unflatten.int:
            assert tuple(node.meta["val"].shape[-2:]) == (heads, 128)
    sums = (functional.all_reduce.default, collectives.reduce_scatter_start)  # (rows sharded over tp: reduce-scattered)
    per_module = Counter(list(n.meta["nn_module_stack"].values())[-1][0] for n in graph.nodes if n.target in sums)
    per_block = Counter(re.sub(r"^transformer_blocks\.\d+\.", "", m) for m in per_module
                        if m.startswith("transformer_blocks."))
    assert per_block == {"adaln_proj.linear": 50, "attn.to_out.0": 50, "ff.net.2": 50}
    total = sum(p.numel() for p in model.parameters())
    report = partitioned.report()
    counts = [count for count, _ in report.rank_parameters]
    assert len(counts) == 16 and counts[rank] == report.parameters
    assert max(counts) <= total / 16 * 1.05 and min(counts) >= total / 16 * 0.95, (max(counts), min(counts))
    largest = report.parameter_extremes()["largest"]
    assert largest["rank"] == 0 and report.parameter_extremes()["smallest"]["rank"] == 15
    assert largest["bytes"] + report.activation_peak_bytes < 24 * 2**30
