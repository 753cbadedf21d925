"""flex_attention under tensor and batch parallelism: heads (batch) split like scaled_dot_product_attention's, its
score_mod and mask_mod still numbering heads and batch globally, every rank against the single-device model."""

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import partitioner
from partitioner.api import planned
from partitioner.errors import PartitionError
from partitioner.testing import run_ranks


class FlexBlock(nn.Module):
    """One attention block written with flex_attention; ``mode`` picks what its score_mod and block mask read."""

    def __init__(self, mode: str, heads: int = 3, head_dim: int = 16):
        super().__init__()
        self.mode, self.heads, width = mode, heads, heads * head_dim
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.context_kv = nn.Linear(width, 2 * width)

    def forward(self, x, context):
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.mode == "cross":  # keys and values of a context every row attends to (whole under Ulysses)
            k, v = self.context_kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * (1 + 0.25 * h) - 0.01 * j)
        elif self.mode == "causal":  # a block mask over query and key indices, a distance score
            mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device="cpu")
            y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.01 * (i - j), block_mask=mask)
        elif self.mode == "per_head_mask":  # a block mask per head (its tensors carry the head dim)
            mask = create_block_mask(lambda b, h, i, j: (i >= j) | (h == 0), None, self.heads, n, n, device="cpu")
            y = flex_attention(q, k, v, block_mask=mask)
        else:  # a temperature per batch and head (a shift per row would cancel in the softmax)
            y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * (1 + 0.5 * b + 0.25 * h))
        return self.out(y.transpose(1, 2).reshape(b, n, width))


MODES = ("causal", "per_head_mask", "indices", "cross")


def _ranks(rank, world, axes: tuple[str, str], heads: int, globalize: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import localize

    if not globalize:  # the negative control: every rank's score_mod counts its own heads and batch from 0
        localize._globalize_flex_indices = lambda gm, node, mesh: None
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=axes)
    results = {}
    for mode in MODES:
        torch.manual_seed(0)
        model, x = FlexBlock(mode, heads).eval().requires_grad_(False), torch.randn(2, 135, heads * 16)
        context = torch.randn(2, 9, heads * 16)
        partitioned = partitioner.partition(model, mesh, ((x, context), {}))
        with torch.no_grad():
            expected, out = model(x, context), partitioned.compile()(x, context)
        results[mode] = ((out - expected).abs().max().item(), partitioned.linear_styles["qkv"],
                         dict(partitioned.collective_counts()))
    return results


@pytest.mark.slow
def test_flex_attention_splits_heads_and_batch_exactly():
    """dp=2 x tp=2 and tp=2 x ulysses=2, 3 heads (2 + 1 per tp rank; 1 + 1 and 1 + 0 per Ulysses rank: one rank
    without heads), batch 2, 135 rows (68 + 67 per Ulysses rank): exact on every rank (float32 sums in another
    order: 1e-5), the attention's heads split (qkv column-parallel, q, k, v and the output exchanged under
    Ulysses); without the global indices the scores that read the head or batch index are wrong (the control)."""
    for axes, heads in ((("dp", "tp"), 3), (("tp", "ulysses"), 3)):
        for outcome in run_ranks(4, _ranks, axes, heads, True):
            for mode, (error, qkv, counts) in outcome.items():
                assert error < 1e-5, (axes, mode, error)
                assert qkv.startswith("colwise") and counts.get(("all_reduce", "tp")) == 1, (axes, mode, counts)
                # q, k, v and the output exchanged; a whole context's keys and values sliced by heads
                exchanges = 2 if mode == "cross" else 4
                assert counts.get(("all_to_all", "ulysses"), exchanges) == exchanges, (mode, counts)
    controls = run_ranks(4, _ranks, ("tp", "ulysses"), 3, False)
    assert all(outcome["causal"][0] < 1e-5 for outcome in controls)  # reads no head or batch index
    assert max(outcome["indices"][0] for outcome in controls) > 1e-2
    assert max(outcome["per_head_mask"][0] for outcome in controls) > 1e-2


class JointFlex(nn.Module):
    """Text and image rows projected apart and joined along the rows (an MMDiT's joint sequence), one causal
    flex_attention over both with a score by head and distance: under Ulysses the joint rows are a packed shard,
    exchanged rank by rank."""

    def __init__(self, heads: int = 4, head_dim: int = 16):
        super().__init__()
        self.heads, width = heads, heads * head_dim
        self.qkv, self.text_qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width), \
            nn.Linear(width, width)

    def forward(self, x, text):
        b, _, width = x.shape
        joint = torch.cat([self.text_qkv(text), self.qkv(x)], 1)
        rows = joint.shape[1]
        q, k, v = joint.view(b, rows, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, rows, rows, device="cpu")
        y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * (1 + 0.1 * h) - 0.01 * (i - j),
                           block_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, rows, width)[:, text.shape[1]:])


def _joint(rank, world, in_order: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import collective_kernels

    if not in_order:  # the control: flex_attention reads the joint rows as the exchange delivers them
        collective_kernels._flex_in_sequence_order = lambda gm, ctx: None
    torch.manual_seed(0)
    model, x, text = JointFlex().eval().requires_grad_(False), torch.randn(1, 64, 64), torch.randn(1, 7, 64)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",)),
                                        ((x, text), {}))
    with torch.no_grad():
        error = (partitioned.compile()(x, text) - model(x, text)).abs().max().item()
    return error, dict(partitioned.collective_counts())


@pytest.mark.slow
def test_flex_attention_over_a_joint_sequence_reads_it_in_sequence_order():
    """7 text + 64 image rows at Ulysses=2 (4 + 32 and 3 + 32 per rank): the exchanged rows are put back in
    sequence order for the causal block mask and the distance score, and the output back in rank order for the
    exchange back; exact on both ranks, wrong without the reordering (the control)."""
    for error, counts in run_ranks(2, _joint, True):
        assert error < 1e-5 and counts[("all_to_all", "ulysses")] == 4, (error, counts)
    assert max(error for error, _ in run_ranks(2, _joint, False)) > 1e-2


def test_flex_attention_has_no_ring_form():
    model, x = FlexBlock("causal").eval().requires_grad_(False), torch.randn(1, 64, 48)
    with pytest.raises(PartitionError, match="no ring form of flex_attention"):
        planned(model, {"ring": 2}, ((x, torch.randn(1, 5, 48)), {}))


def test_grouped_query_flex_attention_is_left_whole_by_name():
    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            b, n, _ = x.shape
            q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
            k, v = self.kv(x).view(b, n, 2, 2, 8).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2)

    ctx = planned(Grouped().eval().requires_grad_(False), {"tp": 2}, ((torch.randn(1, 8, 32),), {}))
    assert str(ctx.linear_styles["q"]) == "replicate"
    assert "grouped-query flex_attention" in ctx.replicated_because["q"], ctx.replicated_because
