"""Tensor parallelism on real gloo ranks: every rank's outputs against the single-device model.

Tolerance. Everything runs in float32. Sharding changes only the order of additions: a row-parallel matmul sums
K/tp products per rank and then adds tp partial sums, where the reference sums all K at once. The difference of two
summation orders of K float32 products is bounded by about K * eps * sum|x_i w_i| (eps = 1.2e-7); with K <= 96 here
and activations of order 1 that is ~1e-5 in the worst case, and measured max differences are ~4e-7. We assert
``atol = rtol = 1e-5``: 100x tighter than the 1e-3 diffusers uses for its TP tests, yet above the worst-case
reordering bound. The negative controls (one all_reduce removed) miss by more than 1e-3, so the tolerance separates
a correct partition from a broken one by two orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch

from partitioner.testing import TINY_H3, drop_all_reduce, flux_inputs, h3_inputs, run_ranks, tiny_flux, tiny_h3

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# Removing this all_reduce leaves the last block's attention output as a per-rank partial sum.
DROPPED_REDUCE = "transformer_blocks.1.attn.to_out.0"


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _h3_case(world: int, *, plan=None, drop: str | None = None) -> dict:
    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    partitioned = partitioner.partition(model, _mesh(world), ((), inputs), plan=plan)
    if drop:
        drop_all_reduce(partitioned, drop)
    compiled = partitioned.compile()
    as_tuple = compiled(**inputs, return_dict=False)
    as_output = compiled(**inputs)
    return dict(expected=expected, as_tuple=as_tuple, as_output=as_output, styles=partitioned.linear_styles,
                report=partitioned.report())


def _flux_case(world: int) -> dict:
    """A second diffusers transformer (MMDiT double + single-stream blocks), planned from structure alone."""
    import partitioner

    model, inputs = tiny_flux(), flux_inputs()
    with torch.no_grad():
        expected = model(**inputs).sample
    partitioned = partitioner.partition(model, _mesh(world), ((), inputs))
    return dict(expected=expected, actual=partitioned.compile()(**inputs).sample, styles=partitioned.linear_styles)


OVERRIDES = {"transformer_blocks.*.attn.to_out.0": "replicate", "proj_in": "colwise"}


def _tp2_cases(rank: int, world: int) -> dict:
    return dict(plain=_h3_case(world), dropped=_h3_case(world, drop=DROPPED_REDUCE),
                overridden=_h3_case(world, plan=OVERRIDES), flux=_flux_case(world))


def _tp4_cases(rank: int, world: int) -> dict:
    return dict(plain=_h3_case(world), dropped=_h3_case(world, drop=DROPPED_REDUCE))


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(2, _tp2_cases)


@pytest.fixture(scope="module")
def tp4():
    return run_ranks(4, _tp4_cases)


def _assert_h3_matches(case: dict) -> None:
    for actual, expected in zip(case["as_tuple"], case["expected"]):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    torch.testing.assert_close(case["as_output"].sample, case["expected"][0], **TOLERANCE)
    torch.testing.assert_close(case["as_output"].audio_sample, case["expected"][1], **TOLERANCE)


@pytest.mark.parametrize("ranks", ["tp2", "tp4"])
def test_h3_every_rank_matches_single_device(ranks, request):
    """TP=2 and TP=4: video and audio outputs of every rank equal the unpartitioned model's."""
    for rank, cases in enumerate(request.getfixturevalue(ranks)):
        assert cases["plain"]["report"].count("all_reduce") > 0, f"rank {rank} communicates nothing"
        _assert_h3_matches(cases["plain"])


@pytest.mark.parametrize("ranks", ["tp2", "tp4"])
def test_h3_without_one_all_reduce_fails(ranks, request):
    """Negative control: the same comparison fails, on every rank, once one inserted all_reduce is removed."""
    for cases in request.getfixturevalue(ranks):
        video, expected = cases["dropped"]["as_tuple"][0], cases["dropped"]["expected"][0]
        assert (video - expected).abs().max() > 1e-3
        with pytest.raises(AssertionError):
            _assert_h3_matches(cases["dropped"])


def test_h3_user_overrides_take_precedence_and_stay_exact(tp2):
    """`_tp_plan`-style overrides change the plan (a replicated output projection un-shards its attention; a
    forced column shard is gathered) and the outputs still match."""
    for cases in tp2:
        case = cases["overridden"]
        assert case["styles"]["transformer_blocks.0.attn.to_out.0"] == "replicate"
        assert case["styles"]["transformer_blocks.0.attn.to_q"] == "replicate"
        assert case["styles"]["token_refiner.refiner_blocks.0.attn.to_q"] == "colwise"
        assert case["styles"]["proj_in"] == "colwise gathered"
        assert case["report"].count("all_gather") == 1
        _assert_h3_matches(case)


def test_flux_every_rank_matches_single_device(tp2):
    """Flux (joint attention, packed cat([attn, mlp]) projection) is sharded from structure and stays exact."""
    for cases in tp2:
        case = cases["flux"]
        assert case["styles"]["single_transformer_blocks.0.proj_out"] == "rowwise"
        assert case["styles"]["transformer_blocks.0.attn.add_q_proj"] == "colwise"
        torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE)


class FusedQKV(torch.nn.Module):
    """One projection for q, k and v, viewed ``[b, n, 3, heads, head_dim]`` and taken apart by ``unbind(2)`` (SanaWM)
    or permuted to ``[3, b, heads, n, head_dim]`` and indexed (PRX, timm's ViT attention)."""

    def __init__(self, permuted: bool, dim: int = 48, heads: int = 6):
        super().__init__()
        self.heads, self.permuted = heads, permuted
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, d // self.heads)
        if self.permuted:
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        else:
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).flatten(2))


def _fused_qkv(rank: int, world: int) -> dict:
    import partitioner

    results = {}
    for permuted, heads in ((False, 6), (True, 6), (True, 3)):  # (3 heads over 2: in whole heads, 2 + 1)
        torch.manual_seed(0)
        model, x = FusedQKV(permuted, heads=heads).eval(), torch.randn(1, 7, 48)
        partitioned = partitioner.partition(model, _mesh(world), ((), dict(x=x)))
        results[permuted, heads] = (partitioned.compile()(x=x), model(x=x), partitioned.linear_styles)
    return results


def test_a_fused_qkv_viewed_into_three_is_packed_by_its_thirds_and_exact():
    """Was: the projection left whole ("unbind along the sharded dim 2" / "select.int along the sharded dim 0"):
    a plain column split gives rank 0 all of q and half of k. Packed as q, k, v, each rank holds its heads of all
    three (3 of the 6 heads; of 3 heads, 2 and 1), exact on every rank."""
    for rank, results in enumerate(run_ranks(2, _fused_qkv)):
        for case, (actual, expected, styles) in results.items():
            assert str(styles["qkv"]).startswith("colwise packed [48, 48, 48]"), styles["qkv"]
            assert str(styles["o"]).startswith("rowwise"), styles["o"]
            torch.testing.assert_close(actual, expected, **TOLERANCE, msg=f"rank {rank} (permuted, heads) {case}")
