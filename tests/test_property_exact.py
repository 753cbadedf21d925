"""Property: any small DiT-like model on any tp/ulysses mesh is exact on every rank, or refused with a named error
on every rank. Never a wrong result, never a raw exception, never ranks that disagree.

The models vary what the rules must handle: head counts and lengths that do not divide the degrees, joint
text+image attention, q/k norms per head or across heads, a rotary embedding written into q and k in place,
AdaLN modulation, GELU or a fused SwiGLU. Four gloo ranks stay alive across examples (``RankPool``).
Tolerance: float32 with sums reordered by sharding, 1e-5 relative to the output's magnitude (test_tp_numerics).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import PartitionerError, partition
from partitioner.testing import RankPool

MESHES = {"tp4": ((4,), ("tp",)), "ulysses4": ((4,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses"))}


class TinyDiT(nn.Module):
    def __init__(self, heads, head_dim, qk_norm, rope, mlp, text):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.qk_norm, self.rope, self.mlp, self.text = heads, qk_norm, rope, mlp, text
        self.modulation = nn.Linear(8, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.text_proj = nn.Linear(6, dim)
        width = head_dim if qk_norm == "head" else dim
        self.q_norm, self.k_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(2 * dim if mlp == "swiglu" else 4 * dim, dim)

    def forward(self, x, cond, angle, text=None):
        shift, scale = self.modulation(cond).unsqueeze(1).chunk(2, -1)
        h = self.norm(x) * (1 + scale) + shift
        if text is not None:
            h = torch.cat([self.text_proj(text), h], 1)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if self.qk_norm == "full":  # across heads, as Wan and LTX-Video do
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:  # rotate the image rows in place, as CogVideoX does
            rows = self.text
            q[:, :, rows:] = q[:, :, rows:] * angle.cos() + q[:, :, rows:].flip(-1) * angle.sin()
            k[:, :, rows:] = k[:, :, rows:] * angle.cos() - k[:, :, rows:].flip(-1) * angle.sin()
        out = self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        x = x + out[:, self.text:]
        m = self.up(self.norm(x))
        if self.mlp == "swiglu":
            value, gate = m.chunk(2, -1)
            m = value * F.silu(gate)
        else:
            m = F.gelu(m)
        return x + self.down(m)


def build(config: dict):
    torch.manual_seed(config["seed"])
    model = TinyDiT(config["heads"], config["head_dim"], config["qk_norm"], config["rope"], config["mlp"],
                    config["text"]).eval()
    g = torch.Generator().manual_seed(config["seed"])
    dim = config["heads"] * config["head_dim"]
    inputs = dict(x=torch.randn(1, config["rows"], dim, generator=g), cond=torch.randn(1, 8, generator=g),
                  angle=torch.randn(config["rows"], config["head_dim"], generator=g))
    if config["text"]:
        inputs["text"] = torch.randn(1, config["text"], 6, generator=g)
    return model, inputs


def _case(rank, world, config):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = MESHES[config["mesh"]]
    model, inputs = build(config)
    with torch.no_grad():
        expected = model(**inputs)
    try:
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs),
                                timeout=60)
        actual = partitioned.compile()(**inputs)
    except PartitionerError as error:
        return "refused", type(error).__name__, str(error).splitlines()[0][:200]
    error = (actual - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    return ("exact" if error <= 1e-5 * scale else "wrong"), error, dict(partitioned.collective_counts())


@pytest.fixture(scope="module")
def ranks():
    with RankPool(4) as pool:
        yield pool


configs = st.fixed_dictionaries(dict(
    heads=st.integers(1, 6), head_dim=st.sampled_from([4, 8]), rows=st.integers(1, 9), text=st.integers(0, 3),
    qk_norm=st.sampled_from(["none", "head", "full"]), rope=st.booleans(), mlp=st.sampled_from(["gelu", "swiglu"]),
    mesh=st.sampled_from(sorted(MESHES)), seed=st.integers(0, 3)))


def _check(outcomes: list, config: dict) -> None:
    kinds = {outcome[0] for outcome in outcomes}
    assert len(kinds) == 1, (config, outcomes)  # every rank the same way
    assert kinds != {"wrong"}, (config, outcomes)
    if kinds == {"refused"}:
        assert len({outcome[1] for outcome in outcomes}) == 1, outcomes


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(config=configs)
def test_random_dits_are_exact_or_refused_on_every_rank(ranks, config):
    _check(ranks.run(_case, config), config)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_model_that_fits_every_mesh_is_never_refused(ranks, mesh):
    """The property must not pass by refusing: 4 heads and 8 rows divide every degree here."""
    config = dict(heads=4, head_dim=8, rows=8, text=2, qk_norm="head", rope=True, mlp="swiglu", mesh=mesh, seed=0)
    outcomes = ranks.run(_case, config)
    _check(outcomes, config)
    assert all(outcome[0] == "exact" and outcome[2] for outcome in outcomes), outcomes
