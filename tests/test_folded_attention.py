"""Attention written out over batch and heads folded into one dim, as diffusers' classic ``AttnProcessor`` writes it
(T5FilmDecoder, any ``Attention`` with ``scale_qk=False``): ``[batch * heads, rows, dim]`` values, scores from
``baddbmm`` (adding a key mask, or an empty tensor it scales by zero), softmax, ``bmm``. Under Ulysses its
self-attention runs on this rank's (batch, head) slices over the whole sequence, its cross-attention on this rank's
query rows over a whole context: every rank against the single-device model. Tolerance: Ulysses changes no
arithmetic of the attention (each slice computed whole), the Linears act row by row: 1e-5 as test_ulysses_numerics.
"""

import pytest
import torch
from torch import nn

import partitioner
from partitioner.runtime import collectives
from partitioner.testing import no_exchange, run_ranks


class FoldedAttention(nn.Module):
    def __init__(self, heads: int = 3, head_dim: int = 8):
        super().__init__()
        self.heads, width = heads, heads * head_dim
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.masked_qkv, self.masked_out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.cross_q, self.cross_kv, self.cross_out = nn.Linear(width, width), nn.Linear(width, 2 * width), \
            nn.Linear(width, width)

    def _fold(self, x):  # diffusers' head_to_batch_dim
        b, n, width = x.shape
        return x.view(b, n, self.heads, -1).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def _unfold(self, x, b):  # batch_to_head_dim
        return x.view(b, self.heads, x.shape[1], -1).permute(0, 2, 1, 3).reshape(b, x.shape[1], -1)

    def _attend(self, q, k, v, added, beta):
        scores = torch.baddbmm(added, q, k.transpose(-1, -2), beta=beta, alpha=q.shape[-1] ** -0.5)
        return torch.bmm(scores.softmax(-1), v)

    def forward(self, x, context, context_mask):
        b, n, _ = x.shape
        q, k, v = (self._fold(t) for t in self.qkv(x).chunk(3, -1))
        empty = torch.empty(q.shape[0], n, n, dtype=x.dtype)
        x = x + self.out(self._unfold(self._attend(q, k, v, empty, 0.0), b))
        q, k, v = (self._fold(t) for t in self.masked_qkv(x).chunk(3, -1))
        causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -10000.0)
        per_head = causal + torch.arange(b * self.heads, dtype=x.dtype)[:, None, None] * 0.1  # one per (batch, head)
        x = x + self.masked_out(self._unfold(self._attend(q, k, v, per_head, 1.0), b))
        k, v = (self._fold(t) for t in self.cross_kv(context).chunk(2, -1))
        mask = (1.0 - context_mask[:, None, :]) * -10000.0  # a key padding mask, one per (batch, head)
        mask = mask.repeat_interleave(self.heads, dim=0)
        return x + self.cross_out(self._unfold(self._attend(self._fold(self.cross_q(x)), k, v, mask, 1.0), b))


class FoldedSdpa(nn.Module):
    """scaled_dot_product_attention over 3-D values (batch and heads folded): its dim 1 is the rows, no heads to
    exchange: left whole, exact."""

    def __init__(self, width: int = 24):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = (t.view(b, n, 3, -1).transpose(1, 2).reshape(b * 3, n, -1) for t in self.qkv(x).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.view(b, 3, n, -1).transpose(1, 2).reshape(b, n, width))


def _ranks(rank, world, drop_exchange: bool):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, x, context = FoldedAttention().eval(), torch.randn(2, 11, 24), torch.randn(2, 5, 24)
    context_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    with torch.no_grad():
        expected = model(x, context, context_mask)
        partitioned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)),
                                            ((x, context, context_mask), {}))
        if drop_exchange:  # the negative control: the self-attention's output never goes back to its rows
            exchanges = [n for n in partitioned.graph_module.graph.nodes if n.target is collectives.all_to_all_start]
            exchanges[-1].target = no_exchange
            partitioned.graph_module.recompile()
        actual = partitioned.compile()(x, context, context_mask)
    kinds = {where: str(decided) for where, decided in partitioned.ctx.sequence_attention.items()}
    sdpa = FoldedSdpa().eval()
    with torch.no_grad():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",))
        sdpa_error = (partitioner.partition(sdpa, mesh, ((x,), {})).compile()(x) - sdpa(x)).abs().max().item()
    return (actual - expected).abs().max().item(), dict(partitioned.collective_counts()), kinds, sdpa_error


@pytest.mark.slow
def test_folded_attention_is_sequence_sharded_exactly():
    """Batch 2 x 3 heads folded (6 slices: 3 + 3 per rank), 11 rows (6 + 5): exact; each self-attention (one
    scaling an empty tensor by zero, one adding a causal mask that differs per (batch, head), cut with its slices)
    exchanges q, k, v to (batch, head) slices and its output back (4 all_to_alls each), the cross-attention runs on
    the query rows over the whole masked context. Without the last exchange back the output is wrong (the control).
    A scaled_dot_product_attention over 3-D values (its dim 1 is rows, not heads) is left whole: exact."""
    for error, counts, kinds, sdpa_error in run_ranks(2, _ranks, False):
        assert error < 1e-5 and sdpa_error < 1e-5, (error, sdpa_error)
        assert counts.get(("all_to_all", "ulysses")) == 8, counts
        assert sorted(kind.split(" (")[1].split(";")[0] for kind in kinds.values()) == [
            "Ulysses all_to_all)", "Ulysses all_to_all)", "query rows"], kinds
    assert all(outcome[0] > 1e-3 for outcome in run_ranks(2, _ranks, True))
