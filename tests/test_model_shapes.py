"""Model idioms beyond H3 and Flux, each checked on real gloo ranks against the single device: the ways people
write fused projections, joint attention, masks and reshapes must plan correctly or refuse clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partitioner
from partitioner.testing import run_ranks

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


class SplitSwiGLU(nn.Module):
    """A fused [value; gate] projection cut with `split` rather than `chunk`."""

    def __init__(self, sizes_list: bool):
        super().__init__()
        self.proj, self.down, self.sizes_list = nn.Linear(16, 32), nn.Linear(16, 16), sizes_list

    def forward(self, x):
        value, gate = self.proj(x).split([16, 16] if self.sizes_list else 16, dim=-1)
        return self.down(value * F.silu(gate))


class JointAttention(nn.Module):
    """Two streams projected apart, joined along the sequence, heads split with unflatten(heads, -1)."""

    def __init__(self, heads=4, dim=32):
        super().__init__()
        self.heads = heads
        self.qkv_a, self.qkv_b = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, a, b):
        qa, ka, va = self.qkv_a(a).chunk(3, -1)
        qb, kb, vb = self.qkv_b(b).chunk(3, -1)
        q, k, v = (torch.cat([x.unflatten(-1, (self.heads, -1)), y.unflatten(-1, (self.heads, -1))], 1).transpose(1, 2)
                   for x, y in ((qa, qb), (ka, kb), (va, vb)))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class LikeOps(nn.Module):
    """`zeros_like` of a column-sharded value takes its shape from it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.where(h > 0, h, torch.zeros_like(h)))


class ViewHeads(nn.Module):
    """Heads split with view(B, S, heads, -1), as older diffusers processors do."""

    def __init__(self, heads=4, dim=32):
        super().__init__()
        self.heads, self.q, self.k, self.v, self.o = heads, *(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MaskedAttention(ViewHeads):
    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, -1))


def _cases():
    g = torch.Generator().manual_seed(0)
    x = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "split_sizes": (lambda: SplitSwiGLU(True), {"x": x(2, 3, 16)}),
        "split_size": (lambda: SplitSwiGLU(False), {"x": x(2, 3, 16)}),
        "joint_unflatten": (JointAttention, {"a": x(1, 5, 32), "b": x(1, 3, 32)}),
        "zeros_like": (LikeOps, {"x": x(3, 8)}),
        "view_heads_odd_rows": (ViewHeads, {"x": x(1, 5, 32)}),
        "masked": (MaskedAttention, {"x": x(1, 6, 32), "mask": x(1, 1, 6, 6) > -1}),
    }


def _run(rank: int, world: int, axis: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    results = {}
    for name, (factory, inputs) in _cases().items():
        torch.manual_seed(0)
        model = factory().eval()
        with torch.no_grad():
            expected = model(**inputs)
        partitioned = partitioner.partition(model, mesh, ((), inputs))
        results[name] = dict(expected=expected, actual=partitioned.compile()(**inputs),
                             styles=partitioned.linear_styles, report=partitioned.report(),
                             stopped=partitioned.ctx.sequence_stopped)
    return results


@pytest.fixture(scope="module")
def tp():
    return run_ranks(2, _run, "tp")


@pytest.fixture(scope="module")
def ulysses():
    return run_ranks(2, _run, "ulysses")


@pytest.mark.parametrize("axis", ["tp", "ulysses"])
@pytest.mark.parametrize("name", sorted(_cases()))
def test_every_rank_matches_single_device(request, axis, name):
    for results in request.getfixturevalue(axis):
        torch.testing.assert_close(results[name]["actual"], results[name]["expected"], **TOLERANCE)


def test_tensor_parallel_plans(tp):
    """Fused projections cut with `split` are packed column shards; joint attention shards both streams."""
    case = tp[0]
    assert case["split_sizes"]["styles"]["proj"] == "colwise packed [16, 16]"
    assert case["split_size"]["styles"]["proj"] == "colwise packed [16, 16]"
    assert case["joint_unflatten"]["styles"] == {"qkv_a": "colwise packed [32, 32, 32]",
                                                 "qkv_b": "colwise packed [32, 32, 32]", "out": "rowwise"}


def test_sequence_parallel_plans(ulysses):
    """An odd row count split by view still gets Ulysses (3 + 2 rows); a masked attention is not
    sequence-sharded, and the reason is recorded."""
    case = ulysses[0]
    assert case["view_heads_odd_rows"]["report"].count("all_to_all") == 4
    assert case["masked"]["report"].count("all_to_all") == 0
    assert any("mask" in reason for reason in case["masked"]["stopped"].values())
