"""Sharding rules of gather, repeat and fill (Lumina2's rotary tables gathered by per-token positions, its grouped
key/value heads tiled, position ids written by fill), checked on exported one-op graphs: the placement a rule
gives is what the op's semantics allow, and a case it cannot serve exactly is Unshardable."""

from __future__ import annotations

import pytest
import torch

from partitioner.placement import Shard
from partitioner.rules.core import R, Unshardable, rule_for

aten = torch.ops.aten


def _node(fn, *inputs, target):
    class Wrap(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    gm = torch.export.export(Wrap(), inputs).graph_module
    node = next(n for n in gm.graph.nodes if n.target is target)
    return node, [n for n in gm.graph.nodes if n.op == "placeholder"]


def _decide(node, placements):
    return rule_for(node)(node, placements, 2)


def test_gather_along_the_split_dim_reads_a_whole_table():
    table, positions = torch.randn(1, 16, 8), torch.randint(0, 16, (1, 6, 8))
    node, (t, p) = _node(lambda t, p: torch.gather(t, 1, p), table, positions, target=aten.gather.default)
    decision = _decide(node, {p: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs[t] == R and decision.inputs[p] == Shard(1)
    with pytest.raises(Unshardable):  # the table split along the gathered dim: rows of other ranks are read
        _decide(node, {t: Shard(1)})


def test_gather_along_another_dim_splits_table_and_index_alike_when_they_match():
    node, (t, p) = _node(lambda t, p: torch.gather(t, 1, p), torch.randn(4, 16, 8), torch.randint(0, 16, (4, 6, 8)),
                         target=aten.gather.default)
    decision = _decide(node, {p: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs[t] == Shard(0)
    node, (t, p) = _node(lambda t, p: torch.gather(t, 1, p), torch.randn(4, 16, 8), torch.randint(0, 16, (2, 6, 8)),
                         target=aten.gather.default)
    with pytest.raises(Unshardable):  # index rows 0-1 of 4 table rows: splitting both would misalign them
        _decide(node, {p: Shard(0)})


def test_repeat_passes_a_shard_only_where_it_is_not_tiled():
    x = torch.randn(2, 8, 1, 4)
    node, (a,) = _node(lambda a: a.repeat(1, 1, 3, 1), x, target=aten.repeat.default)
    assert _decide(node, {a: Shard(1)}).output == Shard(1)
    with pytest.raises(Unshardable):  # tiled along the split dim
        node, (a,) = _node(lambda a: a.repeat(1, 2, 1, 1), x, target=aten.repeat.default)
        _decide(node, {a: Shard(1)})
    node, (a,) = _node(lambda a: a.repeat(3, 1, 1, 1, 1), x, target=aten.repeat.default)  # a leading new dim
    assert _decide(node, {a: Shard(1)}).output == Shard(2)


def test_fill_keeps_its_target_placement_and_a_whole_value():
    node, (a, v) = _node(lambda a, v: torch.ops.aten.fill.Tensor(a, v), torch.randn(4, 6), torch.tensor(2.0),
                         target=aten.fill.Tensor)
    decision = _decide(node, {a: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs[v] == R
