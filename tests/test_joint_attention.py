"""Joint (MMDiT) attention under Ulysses: text and image rows, each sharded on its own, concatenated into a packed
sequence whose rows reach the attention in rank order; with a mask over the joint sequence (text padding), which
must be reordered as the rows are. Exact on every rank (float32, 1e-5 as in test_tp_numerics), and wrong when the
mask is not reordered (the negative control)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import partition
from partitioner.testing import run_ranks

TOLERANCE = 1e-5


class MaskedJointAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.text_qkv, self.image_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.text_out, self.image_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, text, image, mask):
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        tq, tk, tv = self.text_qkv(text).chunk(3, -1)
        iq, ik, iv = self.image_qkv(image).chunk(3, -1)
        q, k, v = (split(torch.cat(pair, 1)) for pair in ((tq, iq), (tk, ik), (tv, iv)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        return self.text_out(out[:, :text.shape[1]]), self.image_out(out[:, text.shape[1]:])


def _run(rank, world, reorder):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import collective_kernels

    torch.manual_seed(0)
    model = MaskedJointAttention().eval()
    text, image = torch.randn(1, 4, 32), torch.randn(1, 8, 32)
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool)
    mask[..., 2:4] = False  # the last two text rows are padding: no row attends to them
    if not reorder:
        collective_kernels._masks_in_rank_order = lambda gm, ctx: None
    partitioned = partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)),
                            ((text, image, mask), {}))
    with torch.no_grad():
        expected = model(text, image, mask)
    got = partitioned.compile()(text, image, mask)
    error = max((g - e).abs().max().item() for g, e in zip(got, expected))
    return error, partitioned.explain(), partitioned.collective_counts()


@pytest.mark.parametrize("world", [2, 4])
def test_masked_joint_attention_is_sequence_sharded_and_exact(world):
    for error, explained, counts in run_ranks(world, _run, True):
        assert error <= TOLERANCE, error
        assert "sequence-sharded (Ulysses all_to_all)" in explained
        assert counts[("all_to_all", "ulysses")] == 4  # q, k, v in; the output back


def test_negative_control_a_mask_left_in_sequence_order_is_wrong():
    assert min(error for error, *_ in run_ranks(2, _run, False)) > 1e-3


class WholeJointValues(nn.Module):
    """Helios' layout: joint keys packed (text and image rows each sharded on its own), values computed whole (a
    running sum over the joint rows needs all of them). The packed keys arrive in rank order, the whole values in
    sequence order: the values are put in the keys' order (was: the attention left whole)."""

    def __init__(self, dim=32, heads=4, queries_are_values=False):
        super().__init__()
        self.heads, self.queries_are_values = heads, queries_are_values
        self.text_qk, self.image_qk, self.v, self.out = (nn.Linear(dim, n * dim) for n in (2, 2, 1, 1))

    def forward(self, text, image):
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        tq, tk = self.text_qk(text).chunk(2, -1)
        iq, ik = self.image_qk(image).chunk(2, -1)
        v = split(self.v(torch.cat([text, image], 1).cumsum(1)))
        k = split(torch.cat([tk, ik], 1))
        if self.queries_are_values:  # (and the keys' own attention, so that they stay packed)
            out = F.scaled_dot_product_attention(v, k, v) + F.scaled_dot_product_attention(k, k, k)
        else:
            out = F.scaled_dot_product_attention(split(torch.cat([tq, iq], 1)), k, v)
        return self.out(out.transpose(1, 2).flatten(2))


def _whole_values(rank, world, reorder):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import collective_kernels

    if not reorder:
        collective_kernels._values_in_rank_order = lambda gm, ctx: None
    results = []
    for queries_are_values in (False, True):
        torch.manual_seed(0)
        model, text, image = WholeJointValues(queries_are_values=queries_are_values).eval(), torch.randn(1, 5, 32), \
            torch.randn(1, 8, 32)
        partitioned = partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)),
                                ((text, image), {}))
        with torch.no_grad():
            error = (partitioned.compile()(text, image) - model(text, image)).abs().max().item()
        results.append((error, partitioned.explain()))
    return results


def test_packed_keys_meet_whole_values_in_their_rank_order():
    """Also where the queries are the values themselves: only the value slot is reordered, the queries keep their
    order (the output's exchange back assumes it)."""
    for results in run_ranks(2, _whole_values, True):
        for error, explained in results:
            assert error <= TOLERANCE, error
            assert "sequence-sharded (Ulysses all_to_all)" in explained
    assert min(error for error, _ in run_ranks(2, _whole_values, False)[0]) > 1e-3  # negative control: in order
