"""Full-size MiniMax-H3 at TP=8 x Ulysses=4 (32 ranks) and TP=8 x Ulysses=8 (64 ranks), planned on PyTorch's fake
process group: exchanges, their groups and the shapes they move, for the last rank of the job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from partitioner.passes.device_layout import memory_order
from partitioner.runtime import collectives
from partitioner.placement import shard_sizes
from partitioner.testing import FULL_H3_ROWS, fake_mesh, full_h3_on_meta

ROWS = sum(FULL_H3_ROWS.values())  # 37888 packed rows
HEADS, HEAD_DIM, TP, BLOCKS = 56, 128, 8, 50


@pytest.fixture(scope="module", params=[4, 8], ids=["tp8_u4", "tp8_u8"])
def planned(request):
    import partitioner

    ulysses = request.param
    model, inputs = full_h3_on_meta()
    rank = TP * ulysses - 1  # tp coordinate 7, ulysses coordinate ulysses - 1: the smallest head share
    with fake_mesh((TP, ulysses), ("tp", "ulysses"), rank) as mesh:
        # the tp plan's and Ulysses' own exchanges; rows sharded over tp too are tests/test_tp_sequence.py's
        partitioned = partitioner.partition(model, mesh, ((), inputs), overlap={"tp_sequence": False})
        exchanges = [n for n in partitioned.graph_module.graph.nodes if n.target is collectives.all_to_all_start]
        groups = {n.args[-1]: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(n.args[-1]))
                  for n in exchanges}
        yield ulysses, partitioned, exchanges, groups


def test_all_to_all_per_attention(planned):
    """4 per attention: q, k and v go from sequence- to head-sharded (3), the output back (1); fusing q/k/v into one
    exchange would save launches, not bytes. The two refiner attentions run on the text rows, sharded along them,
    before those rows are packed into the main sequence by index: the text is gathered once, after them."""
    _, partitioned, exchanges, _ = planned
    per_attention = {}
    for node in exchanges:
        module = list(node.meta["nn_module_stack"].values())[-1][0]
        attention = module.split(".attn")[0]
        per_attention[attention] = per_attention.get(attention, 0) + 1
    refiner = {f"token_refiner.refiner_blocks.{i}": 4 for i in range(2)}
    assert per_attention == {**refiner, **{f"transformer_blocks.{i}": 4 for i in range(BLOCKS)}}
    assert partitioned.report().count("all_to_all") == 4 * (BLOCKS + 2)
    # the refined text once, before it is packed; the sequence once, after the output heads
    assert partitioned.report().count("all_gather") == 3


def test_all_to_all_groups_are_contiguous(planned):
    """Every exchange runs on one group of consecutive ranks (Neuron rejects strided all-to-all groups)."""
    ulysses, _, _, groups = planned
    assert len(groups) == 1
    (ranks,) = groups.values()
    assert ranks == list(range(ranks[0], ranks[0] + ulysses)) and len(ranks) == ulysses


def test_shapes_before_and_after_the_exchange(planned):
    """Before: 7 heads (56 / tp 8) of this rank's rows; after: this rank's share of those 7 heads over all rows.
    At Ulysses=8 the last rank holds no head (7 heads over 8 ranks): correct, and the report says so by shape."""
    ulysses, _, exchanges, _ = planned
    rows = shard_sizes(ROWS, ulysses)[-1]
    heads = shard_sizes(HEADS // TP, ulysses)[-1]
    assert heads == (1 if ulysses == 4 else 0)
    main = [n for n in exchanges if "transformer_blocks" in list(n.meta["nn_module_stack"].values())[-1][0]]
    into_heads = [n for n in main if n.args[1] == 1]  # scatter_dim 1: heads
    assert len(into_heads) == 3 * BLOCKS
    for node in into_heads:
        assert tuple(node.args[0].meta["val"].shape) == (1, HEADS // TP, rows, HEAD_DIM)
        assert tuple(_received(node).shape) == (1, heads, ROWS, HEAD_DIM)
    for node in main:
        if node.args[1] == 2:  # back to sequence sharding
            assert tuple(_received(node).shape) == (1, HEADS // TP, rows, HEAD_DIM)


def _received(exchange):
    """What an issued all_to_all gives once waited on."""
    (wait,) = exchange.users
    return wait.meta["val"]


def test_tp_collectives_unchanged_and_sequence_sharded(planned):
    """Composition: the tp all_reduces are those of TP alone, each over this rank's rows only."""
    ulysses, partitioned, _, _ = planned
    report = partitioned.report()
    assert report.count("all_reduce") == 3 * BLOCKS + 2 * 2 + 4
    rows = shard_sizes(ROWS, ulysses)[-1]
    for node in partitioned.graph_module.graph.nodes:
        if node.target is torch.ops._c10d_functional.all_reduce.default and \
                "attn.to_out" in list(node.meta["nn_module_stack"].values())[-1][0] and \
                "transformer_blocks" in list(node.meta["nn_module_stack"].values())[-1][0]:
            assert node.meta["val"].shape[1] == rows


def test_exchanges_travel_in_the_layout_the_ranks_device_makes(planned):
    """Every exchange sends [batch, rows, heads, dim]: the query, key and value arrive joined along their rows with
    no copy, and the attention's output, which CPU's fused kernel writes in that layout, leaves split by rows with no
    copy. The model was traced on the meta device, whose attention writes [batch, heads, rows, dim] (the negative
    control: its traced layout alone would send the output in logical order, a copy on each side)."""
    _, _, exchanges, _ = planned
    assert {tuple(n.args[6]) for n in exchanges} == {(0, 2, 1, 3)}
    outputs = [n for n in exchanges if n.args[0].target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(outputs) == BLOCKS + 2
    assert all(memory_order(n.args[0].meta["val"].stride()) is None for n in outputs)
