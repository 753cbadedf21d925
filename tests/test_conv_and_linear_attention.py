"""Convolutions and linear attention, the two op families of Sana's blocks, written here as a block of our own (the
rules are about ops, not about Sana): a linear attention spelled out with matmuls (ReLU kernel, a row of ones padded
onto the values for the normaliser), a cross-attention to text rows (its query rows are the sequence Ulysses
splits: the block has no self-attention SDPA) and a convolutional feed-forward (1x1 convolution -> 3x3 depthwise convolution
-> gated halves -> 1x1 convolution) over the image the rows make.

- TP=2: the 1x1 convolutions are linears (``pointwise_convs``): the first column-sharded in two packed halves, the
  depthwise convolution on each rank's channels (its own number of groups), the last row-sharded; the attention's
  heads are a batch dim of its matmuls. Parameters are cut when loaded.
- Ulysses=2: the rows stay split through the attention (each rank sums its rows' ``v^T k``, one all_reduce of a
  ``[heads, d + 1, d]`` state) and through the depthwise convolution (each rank borrows one image row from each
  neighbour: a halo exchange). Sequence rows that are not whole image rows on every rank are gathered before the
  convolution instead.
- TP=2 x Ulysses=2: both.
- The normaliser written as the keys summed over the rows (diffusers' Sana processors): a partial sum, all_reduced.
Exact on every rank against the unpartitioned block (1e-5, float32 with sums reordered, as test_tp_numerics), with
negative controls that drop the halo exchange and the attention's all_reduce, which must then be wrong.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch

from partitioner.testing import ConvLinearAttentionBlock, RankPool
from partitioner.annotations import annotation

TOLERANCE = 1e-5
MODES = {"tp2": ((2,), ("tp",)), "ulysses2": ((2,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses"))}


def _without_halo(x, weight, bias, stride, padding, dilation, groups, *_):
    """Negative control: each rank convolves its own rows alone, zeros where its neighbours' rows belong."""
    from partitioner.runtime.collectives import padded_convolution

    return padded_convolution(x, weight, bias, stride, padding, dilation, groups)


def _case(rank, world, mode, height, broken, key_sum=False):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner import partition
    from partitioner.runtime import collectives

    torch.manual_seed(0)
    model = ConvLinearAttentionBlock(height=height, key_sum=key_sum).eval()
    x, text = torch.randn(1, height * 6, 32), torch.randn(1, 5, 16)
    shape, names = MODES[mode]
    with mock.patch.object(collectives, "halo_convolution", _without_halo) if broken == "halo" \
            else contextlib.nullcontext():
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((x, text), {}))
    if broken == "all_reduce":  # the attention's state left a per-rank partial sum
        graph = partitioned.graph_module.graph
        for reduce in [n for n in graph.nodes if annotation(n).collective == ("all_reduce", "ulysses")]:
            wait = next(iter(reduce.users))
            wait.replace_all_uses_with(reduce.args[0])
            graph.erase_node(wait)
            graph.erase_node(reduce)
        partitioned.graph_module.recompile()
    with torch.no_grad():
        expected = model(x, text)
    got = partitioned.compile()(x, text)
    local = {name: tuple(t.shape) for name, t in partitioned.state.items() if name.startswith(("expand", "mix"))}
    return dict(error=(got - expected).abs().max().item(), styles=partitioned.linear_styles,
                collectives={f"{k}:{a}": n for (k, a), n in partitioned.collective_counts().items()}, local=local)


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


def _run(pools, mode, height=6, broken=None, key_sum=False):
    return pools[math.prod(MODES[mode][0])].run(_case, mode, height, broken, key_sum)


@pytest.mark.parametrize("mode", list(MODES))
def test_conv_feed_forward_and_linear_attention_are_exact(pools, mode):
    results = _run(pools, mode)
    for rank, result in enumerate(results):
        assert result["error"] <= TOLERANCE, (rank, result)
    first = results[0]
    if "tp" in mode:
        styles = first["styles"]
        assert styles["expand"] == "colwise packed [24, 24]" and styles["project"] == "rowwise", styles
        assert styles["q"] == styles["k"] == styles["v"] == "colwise" and styles["out"] == "rowwise", styles
        # loaded cut: the 1x1 expansion's weight [48, 32, 1, 1] and the depthwise weight [48, 1, 3, 3] by channels
        assert first["local"]["expand.weight"] == (24, 32, 1, 1) and first["local"]["mix.weight"] == (24, 1, 3, 3)
    if "ulysses" in mode:
        # one halo exchange for the depthwise convolution, the attention's state summed: no all_to_all at all
        assert first["collectives"].get("halo_exchange:ulysses") == 1, first["collectives"]
        assert first["collectives"].get("all_reduce:ulysses") == 1, first["collectives"]
        assert not any(key.startswith("all_to_all") for key in first["collectives"]), first["collectives"]


@pytest.mark.parametrize("broken", [None, "all_reduce"])
def test_a_normaliser_summing_the_keys_over_the_rows_is_a_partial_sum(pools, broken):
    """diffusers' Sana processors normalise by the keys summed over the sequence (``k.sum`` over the rows): under
    Ulysses each rank sums its rows and the ``[heads, 1, d]`` sum is all_reduced with the ``v^T k`` state (the rows
    stay split; a reduction over them was refused, which left SanaVideo's first block whole). Dropping the
    all_reduces must be wrong."""
    results = _run(pools, "ulysses2", broken=broken, key_sum=True)
    if broken:
        assert max(r["error"] for r in results) > 100 * TOLERANCE, results
        return
    assert all(r["error"] <= TOLERANCE for r in results), results
    collectives = results[0]["collectives"]
    assert collectives.get("all_reduce:ulysses") == 2 and collectives.get("halo_exchange:ulysses") == 1, collectives
    assert not any(key.startswith("all_to_all") for key in collectives), collectives


class _PooledHeads(torch.nn.Module):
    """A self-attention, then its rows pooled (a mean over the split rows: a partial sum) and read by two Linears
    with biases in a row and by a norm."""

    def __init__(self):
        super().__init__()
        from partitioner.testing import ViewHeads
        self.attention, self.first, self.second = ViewHeads(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        pooled = self.attention(x).mean(1)
        return self.second(self.first(pooled)), torch.nn.functional.layer_norm(pooled, (32,))


def _pooled(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner import partition

    torch.manual_seed(0)
    model, x = _PooledHeads().eval(), torch.randn(1, 7, 32)
    partitioned = partition(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",)), ((x,), {}))
    with torch.no_grad():
        expected = model(x)
    got = partitioned.compile()(x)
    return dict(error=max((g - e).abs().max().item() for g, e in zip(got, expected)),
                collectives={f"{k}:{a}": n for (k, a), n in partitioned.collective_counts().items()})


def test_a_mean_of_the_split_rows_is_summed_once_before_a_linear_and_a_norm(pools):
    """The mean of 7 rows (4 + 3) is each rank's mean scaled by its share, all_reduced once; a Linear reading the
    partial value took it as partial and each rank added its bias (two Linears in a row: off by a bias), and a norm
    reading it too could not be planned."""
    results = pools[2].run(_pooled)
    assert all(r["error"] <= TOLERANCE for r in results), results
    assert results[0]["collectives"].get("all_reduce:ulysses") == 1, results[0]["collectives"]


def test_uneven_image_rows_are_gathered_before_the_convolution(pools):
    """5 image rows over 2 ranks: the 30 sequence rows split 15 + 15 under Ulysses (plain shards), not whole image
    rows of 6, so they do not regroup into the image: no halo exchange, the image is gathered, still exact."""
    results = _run(pools, "ulysses2", height=5)
    assert all(r["error"] <= TOLERANCE for r in results), results
    assert "halo_exchange:ulysses" not in results[0]["collectives"]


@pytest.mark.parametrize("broken", ["halo", "all_reduce"])
def test_negative_control_without_the_halo_or_the_state_sum_is_wrong(pools, broken):
    results = _run(pools, "ulysses2", broken=broken)
    assert max(r["error"] for r in results) > 100 * TOLERANCE, results


def test_neuron_refuses_the_halo_exchange_by_name():
    """Neuron's checks (run on CPU): the halo exchange sends zero-size all_to_all pieces, not known to lower."""
    import partitioner

    model, x, text = ConvLinearAttentionBlock(height=8).eval(), torch.randn(1, 48, 32), torch.randn(1, 5, 16)
    with pytest.raises(partitioner.BackendError, match="convolution over rows split by a sequence axis is not "
                                                       "lowered for Neuron"):
        partitioner.partition(model, {"ulysses": 4}, ((x, text), {}), rank=0, backend_checks="neuron")


class UnbatchedConv(torch.nn.Module):
    """A 1x1 and a depthwise convolution of an image without a batch dim ([C, H, W]): not a linear over dim 1."""

    def __init__(self):
        super().__init__()
        self.point = torch.nn.Conv2d(8, 8, 1)
        self.depth = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x):
        return self.depth(self.point(x))


def test_an_unbatched_convolution_is_left_a_convolution():
    """Planned (tp=2, no ranks needed): the 1x1 convolution is not rewritten (its dim 1 is the image's height, not
    channels) and nothing is sharded through either convolution; with a batch it would be a linear."""
    import partitioner

    partitioned = partitioner.partition(UnbatchedConv().eval(), {"tp": 2}, ((torch.randn(8, 4, 4),), {}))
    targets = {str(n.target) for n in partitioned.planned_graph.graph.nodes}
    assert "aten.conv2d.default" in targets and "aten.linear.default" not in targets
    assert partitioned.report().replicated_share == 1.0
    batched = partitioner.partition(UnbatchedConv().eval(), {"tp": 2}, ((torch.randn(1, 8, 4, 4),), {}))
    assert batched.linear_styles == {"point": "replicate"}
