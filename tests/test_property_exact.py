"""Property: any small DiT-like model on any tp/ulysses mesh is exact on every rank, or refused with a named error
on every rank. Never a wrong result, never a raw exception, never ranks that disagree.

The models vary what the rules must handle: head counts and lengths that do not divide the degrees, joint
text+image attention, q/k norms per head or across heads, a rotary embedding written into q and k in place,
AdaLN modulation from one timestep or one per row (a timestep per frame), GELU or a fused SwiGLU, grouped key/value
heads, a control input adding hints into the block, text given as a list of tensors and outputs as lists, Python
branches on a float input (a guard) or an integer one (traced for its values), text rows reordered by their mask
before the joint attention, a causal or block-causal (by frame) mask over the joint rows, and a second modality
(audio rows) the image rows attend to, the attention written out by hand (scale, soft cap, mask, softmax; or over
batch and heads folded into one dim, as diffusers' AttnProcessor writes it with baddbmm and bmm) or as
``flex_attention`` (split by heads under tp, its score reading the global head index; left whole by name under
ulysses), and a tensor taken through ``**kwargs``. Four gloo ranks stay alive
across examples (``RankPool``).
Tolerance: float32 with sums reordered by sharding, 1e-5 relative to the output's magnitude (test_tp_numerics).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch.nn.attention.flex_attention import flex_attention

from partitioner import PartitionerError, partition
from partitioner.testing import RankPool

MESHES = {"tp4": ((4,), ("tp",)), "ulysses4": ((4,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses"))}


class TinyDiT(nn.Module):
    def __init__(self, heads, head_dim, qk_norm, rope, mlp, text, kv_heads=None, control=False, branch="none",
                 reorder=False, causal="none", cross=False, listed_out=False, attention="sdpa"):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.qk_norm, self.rope, self.mlp, self.text = heads, qk_norm, rope, mlp, text
        self.kv_heads, self.branch, self.reorder = kv_heads or heads, branch, reorder
        self.attention = attention
        self.causal, self.listed_out = causal, listed_out
        self.cross = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4)) if cross else None  # q, k, v, out
        self.modulation = nn.Linear(8, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k, self.v = (nn.Linear(dim, self.kv_heads * head_dim) for _ in range(2))
        self.text_proj = nn.Linear(6, dim)
        self.control_proj = nn.Linear(dim, dim) if control else None
        width = head_dim if qk_norm == "head" else self.kv_heads * head_dim
        self.q_norm = nn.RMSNorm(head_dim if qk_norm == "head" else dim)
        self.k_norm = nn.RMSNorm(width)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(2 * dim if mlp == "swiglu" else 4 * dim, dim)

    def forward(self, x, cond, angle, text=None, mask=None, control=None, audio=None, **kwargs):
        if "offset" in kwargs:  # a tensor the call names, taken by **kwargs (as every transformers forward)
            x = x + kwargs["offset"]
        modulation = self.modulation(cond)  # one timestep, or one per row (a timestep per frame)
        shift, scale = (modulation if cond.dim() == 3 else modulation.unsqueeze(1)).chunk(2, -1)
        if self.branch == "float" and bool(cond.mean() > 0):  # a Python branch on a float input: a guard
            shift = shift * 0.5
        if self.branch == "int" and int(mask.sum()) == mask.numel():  # on an integer input: traced for its values
            scale = scale * 2
        h = self.norm(x) * (1 + scale) + shift
        if control is not None:  # a control branch adding hints into the main block
            h = h + self.control_proj(control)
        if text is not None:
            t = self.text_proj(torch.cat(text, 1) if isinstance(text, list) else text)
            if self.reorder:  # valid text rows first, the padded ones zeroed after them (by the mask's values)
                t = torch.stack([torch.cat([r[m], torch.zeros_like(r[~m])]) for r, m in zip(t, mask.bool())])
            h = torch.cat([t, h], 1)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if self.qk_norm == "full":  # across heads, as Wan and LTX-Video do
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k, v = (t.unflatten(-1, (self.kv_heads, -1)).transpose(1, 2) for t in (k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_heads != self.heads:  # grouped key/value heads, each serving heads // kv_heads query heads
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        if self.rope:  # rotate the image rows in place, as CogVideoX does
            rows = self.text
            q[:, :, rows:] = q[:, :, rows:] * angle.cos() + q[:, :, rows:].flip(-1) * angle.sin()
            k[:, :, rows:] = k[:, :, rows:] * angle.cos() - k[:, :, rows:].flip(-1) * angle.sin()
        masked = {}
        if self.causal == "causal":
            masked = dict(is_causal=True)
        elif self.causal == "block":  # causal by frame (two image rows a frame), the text rows frame 0
            image = torch.arange(h.shape[1] - self.text) // 2 + 1
            frames = torch.cat([torch.zeros(self.text, dtype=torch.long), image])
            masked = dict(attn_mask=frames[:, None] >= frames[None, :])
        out = self.o(self._attend(q, k, v, masked).transpose(1, 2).flatten(2))
        x = x + out[:, self.text:]
        if audio is not None:  # a second modality: the image rows attend to the audio rows
            heads = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
            cq, ck, cv, co = self.cross
            attended = F.scaled_dot_product_attention(heads(cq(x)), heads(ck(audio)), heads(cv(audio)))
            x = x + co(attended.transpose(1, 2).flatten(2))
        m = self.up(self.norm(x))
        if self.mlp == "swiglu":
            value, gate = m.chunk(2, -1)
            m = value * F.silu(gate)
        else:
            m = F.gelu(m)
        x = x + self.down(m)
        return (x, [x.mean(-1), x.amax(-1)]) if self.listed_out else x  # outputs as a list too


    def _attend(self, q, k, v, masked: dict):
        """SDPA; written out by hand (a scale, a soft cap, the mask, softmax, as transformers' eager attention);
        or flex_attention with a temperature per head (a shift per head would cancel in the softmax)."""
        if self.attention == "flex" and not masked:
            return flex_attention(q, k, v, score_mod=lambda score, b, h, i, j: score * (1 + 0.1 * h))
        if self.attention == "folded":
            return self._folded(q, k, v, masked)
        if self.attention != "written":
            return F.scaled_dot_product_attention(q, k, v, **masked)
        scores = torch.tanh(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 / 4.0) * 4.0
        rows = q.shape[2]
        allowed = torch.ones(rows, rows, dtype=torch.bool).tril() if masked.get("is_causal") else \
            masked.get("attn_mask")
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores.softmax(-1) @ v

    def _folded(self, q, k, v, masked: dict):
        """As diffusers' classic AttnProcessor: batch and heads folded into one dim, scores by ``baddbmm`` adding the
        mask (or an empty tensor it scales by zero), ``bmm``."""
        b, heads, rows, dim = q.shape
        q, k, v = (t.reshape(b * heads, rows, dim) for t in (q, k, v))
        allowed = torch.ones(rows, rows, dtype=torch.bool).tril() if masked.get("is_causal") else \
            masked.get("attn_mask")
        added = torch.empty(b * heads, rows, rows) if allowed is None else \
            torch.zeros(rows, rows).masked_fill(~allowed, -10000.0).expand(b * heads, rows, rows)
        scores = torch.baddbmm(added, q, k.transpose(-1, -2), beta=0.0 if allowed is None else 1.0, alpha=dim ** -0.5)
        return torch.bmm(scores.softmax(-1), v).view(b, heads, rows, dim)


def build(config: dict):
    torch.manual_seed(config["seed"])
    heads, text = config["heads"], config["text"]
    kv_heads = heads // 2 if config.get("grouped") and heads % 2 == 0 else heads
    model = TinyDiT(heads, config["head_dim"], config["qk_norm"], config["rope"], config["mlp"], text,
                    kv_heads=kv_heads, control=config.get("control", False), branch=config.get("branch", "none"),
                    reorder=config.get("reorder", False) and text > 0, causal=config.get("causal", "none"),
                    cross=config.get("cross", False), listed_out=config.get("listed", False),
                    attention=config.get("attention", "sdpa")).eval()
    g = torch.Generator().manual_seed(config["seed"])
    dim = heads * config["head_dim"]
    rows = config["rows"]
    cond = torch.randn(1, rows, 8, generator=g) if config.get("per_frame") else torch.randn(1, 8, generator=g)
    inputs = dict(x=torch.randn(1, rows, dim, generator=g), cond=cond,
                  angle=torch.randn(rows, config["head_dim"], generator=g))
    if text:
        rows_of_text = torch.randn(1, text, 6, generator=g)
        inputs["text"] = [rows_of_text[:, :1], rows_of_text[:, 1:]] if config.get("listed") and text > 1 \
            else rows_of_text
    if model.branch == "int" or model.reorder:
        mask = torch.ones(1, max(text, 1), dtype=torch.int64)
        mask[:, : config["seed"] % max(text, 1)] = 0  # padding first: the reorder moves rows
        inputs["mask"] = mask
    if config.get("control"):
        inputs["control"] = torch.randn(1, rows, dim, generator=g)
    if config.get("cross"):
        inputs["audio"] = torch.randn(1, config["seed"] + 3, dim, generator=g)
    if config.get("kwargs"):
        inputs["offset"] = torch.randn(1, rows, dim, generator=g)
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
    pairs = list(zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)))
    error = max((a - e).abs().max().item() for a, e in pairs)
    scale = max(1.0, max(e.abs().max().item() for _, e in pairs))
    return ("exact" if error <= 1e-5 * scale else "wrong"), error, dict(partitioned.collective_counts())


@pytest.fixture(scope="module")
def ranks():
    with RankPool(4) as pool:
        yield pool


configs = st.fixed_dictionaries(dict(
    heads=st.integers(1, 6), head_dim=st.sampled_from([4, 8]), rows=st.integers(1, 9), text=st.integers(0, 3),
    qk_norm=st.sampled_from(["none", "head", "full"]), rope=st.booleans(), mlp=st.sampled_from(["gelu", "swiglu"]),
    mesh=st.sampled_from(sorted(MESHES)), seed=st.integers(0, 3), grouped=st.booleans(), control=st.booleans(),
    branch=st.sampled_from(["none", "int", "float"]), reorder=st.booleans(), per_frame=st.booleans(),
    listed=st.booleans(), causal=st.sampled_from(["none", "causal", "block"]), cross=st.booleans(),
    attention=st.sampled_from(["sdpa", "written", "folded", "flex"]), kwargs=st.booleans()))


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


@pytest.mark.parametrize("features", ["plain", "every feature", "a mask reorder alone", "written attention",
                                      "folded attention"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_model_that_fits_every_mesh_is_never_refused(ranks, mesh, features):
    """The property must not pass by refusing: 4 heads and 8 rows divide every degree here, with every feature the
    generator draws too (grouped heads, a control input, a float branch, reordered text, a timestep per row, text
    and outputs as lists, a second modality), and with a mask reorder alone."""
    config = dict(heads=4, head_dim=8, rows=8, text=2, qk_norm="head", rope=True, mlp="swiglu", mesh=mesh, seed=1)
    if features == "a mask reorder alone":  # (the host prologue cannot take it: traced for the mask's values)
        config.update(reorder=True)
    elif features == "written attention":  # by hand, with a soft cap and a causal mask, grouped heads repeated
        config.update(attention="written", causal="causal", grouped=True)
    elif features == "folded attention":  # batch and heads folded, a mask added by baddbmm (AttnProcessor)
        config.update(attention="folded", causal="block")
    elif features != "plain":
        config.update(grouped=True, control=True, branch="float", reorder=True, per_frame=True, listed=True,
                      cross=True, kwargs=True)
    outcomes = ranks.run(_case, config)
    _check(outcomes, config)
    assert all(outcome[0] == "exact" and outcome[2] for outcome in outcomes), outcomes
