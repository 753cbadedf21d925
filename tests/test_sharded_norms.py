"""Norms over a column-sharded dim (q/k normed across all heads, as Wan, LTX-Video and QwenImage write it): q and k
stay column-sharded and each norm costs one all_reduce of its row statistics, written as a torch norm module
(``aten.rms_norm`` / ``aten.layer_norm``) or spelled out (``x.pow(2).mean(-1)``, a mean over the shard), of a
projection or of one part of a fused q, k, v projection viewed back to its features. Exact at
TP=2 and TP=3 (6 heads of 8), float32, 1e-5 as in test_tp_numerics; with a negative control that skips the
reduction (or the mean's scaling) and must be wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import partition
from partitioner.testing import run_ranks

TOLERANCE = 1e-5


class SpelledRMSNorm(nn.Module):
    """diffusers' RMSNorm as written out: a mean of squares over the features."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class QKNormAcrossHeads(nn.Module):
    """With ``fused``: one q, k, v projection viewed into (3, heads, head_dim), unbound, and q and k viewed back to
    all their features for the norm (SanaWM's attention)."""

    def __init__(self, norm: str, heads=6, head_dim=8, fused=False):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.fused = heads, fused
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.qkv = nn.Linear(dim, 3 * dim) if fused else None
        make = {"rms": lambda: nn.RMSNorm(dim, eps=1e-6), "layer": lambda: nn.LayerNorm(dim),
                "spelled": lambda: SpelledRMSNorm(dim)}[norm]
        self.norm_q, self.norm_k = make(), make()
        for module in (self.norm_q, self.norm_k):
            for p in module.parameters():
                nn.init.uniform_(p, 0.5, 1.5)

    def forward(self, x):
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
            q, k, v = self.norm_q(q.reshape(b, s, -1)), self.norm_k(k.reshape(b, s, -1)), v.reshape(b, s, -1)
        else:
            q, k, v = self.norm_q(self.q(x)), self.norm_k(self.k(x)), self.v(x)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def _run(rank, world, norm, broken, fused=False):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.runtime import collectives
    from partitioner.passes import insert_collectives

    torch.manual_seed(0)
    model, x = QKNormAcrossHeads(norm, fused=fused).eval(), torch.randn(1, 5, 48)
    if broken:  # the negative control: no reduction of the statistics, or no scaling of a partial mean
        collectives._sum_over_ranks = lambda value, group: value
        insert_collectives._scale_partial_means = lambda gm, ctx: None
    partitioned = partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), ((x,), {}))
    with torch.no_grad():
        expected = model(x)
    error = (partitioned.compile()(x) - expected).abs().max().item()
    return error, partitioned.linear_styles, partitioned.collective_counts()[("all_reduce", "tp")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("norm", ["rms", "layer", "spelled"])
def test_a_norm_across_heads_keeps_q_and_k_column_sharded(norm, world):
    for error, styles, all_reduces in run_ranks(world, _run, norm, False):
        assert error <= TOLERANCE, error
        assert styles["q"] == styles["k"] == "colwise" and styles["o"] == "rowwise"
        # q's and k's statistics (a layer norm reduces its mean, then its variance), the output projection
        assert all_reduces == {"rms": 3, "spelled": 3, "layer": 5}[norm]


@pytest.mark.parametrize("norm", ["rms", "spelled"])
def test_negative_control_a_norm_without_its_reduction_is_wrong(norm):
    assert min(error for error, *_ in run_ranks(2, _run, norm, True)) > 1e-3


@pytest.mark.parametrize("norm", ["rms", "spelled"])
def test_a_fused_projection_unbound_and_viewed_back_keeps_its_norm_sharded(norm):
    """The norm's input is a view of one part of a fused q, k, v projection, not the projection itself: still a
    projection's output, its norm one all_reduce (the fused projection was left whole, SanaWM's at 81%)."""
    for error, styles, all_reduces in run_ranks(2, _run, norm, False, True):
        assert error <= TOLERANCE, error
        assert styles["qkv"].startswith("colwise") and styles["o"] == "rowwise", styles
        assert all_reduces == 3, all_reduces
