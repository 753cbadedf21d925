"""Sharding rules of gather, repeat, fill, einsum and one-tensor indexing (Lumina2's rotary tables gathered by
per-token positions, its grouped key/value heads tiled, position ids written by fill; Mochi's rotary angles by
einsum, its valid text rows picked by index), checked on exported one-op graphs: the placement a rule gives is
what the op's semantics allow, and a case it cannot serve exactly is Unshardable. Also: a ``torch.autocast``
region that changes no dtype is inlined by the trace, so the rules see its ops."""

from __future__ import annotations

import pytest
import torch

from partitioner.placement import Partial, Shard
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


def test_embedding_of_split_indices_reads_a_whole_table():
    """A condition-type id per text row (HunyuanVideo 1.5's ``cond_type_embed``): the indices' rows split, the table
    whole; a table split by features gives those features; a table split by rows is refused (any index may need
    any row), checked against the op's values."""
    table, ids = torch.randn(3, 8), torch.randint(0, 3, (1, 6))
    node, (t, i) = _node(lambda t, i: torch.nn.functional.embedding(i, t), table, ids, target=aten.embedding.default)
    decision = _decide(node, {i: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs[t] == R
    whole = torch.nn.functional.embedding(ids, table)
    assert torch.equal(torch.cat([torch.nn.functional.embedding(part, table) for part in ids.chunk(2, 1)], 1), whole)
    assert _decide(node, {t: Shard(1)}).output == Shard(2)
    with pytest.raises(Unshardable):
        _decide(node, {t: Shard(0)})
    with pytest.raises(Unshardable):
        _decide(node, {t: Shard(1), i: Shard(1)})


def test_repeat_passes_a_shard_only_where_it_is_not_tiled():
    x = torch.randn(2, 8, 1, 4)
    node, (a,) = _node(lambda a: a.repeat(1, 1, 3, 1), x, target=aten.repeat.default)
    assert _decide(node, {a: Shard(1)}).output == Shard(1)
    with pytest.raises(Unshardable):  # tiled along the split dim
        node, (a,) = _node(lambda a: a.repeat(1, 2, 1, 1), x, target=aten.repeat.default)
        _decide(node, {a: Shard(1)})
    node, (a,) = _node(lambda a: a.repeat(3, 1, 1, 1, 1), x, target=aten.repeat.default)  # a leading new dim
    assert _decide(node, {a: Shard(1)}).output == Shard(2)


def test_flip_keeps_a_shard_of_another_dim_and_refuses_its_own():
    """SanaWM runs a causal scan backwards by flipping its rows (time): a shard of its features (tp) stays."""
    node, (x,) = _node(lambda x: x.flip(1), torch.randn(1, 6, 8), target=aten.flip.default)
    assert _decide(node, {x: Shard(2)}).output == Shard(2)
    with pytest.raises(Unshardable):  # reversing the split dim moves rows between ranks
        _decide(node, {x: Shard(1)})


def test_fill_keeps_its_target_placement_and_a_whole_value():
    node, (a, v) = _node(lambda a, v: torch.ops.aten.fill.Tensor(a, v), torch.randn(4, 6), torch.tensor(2.0),
                         target=aten.fill.Tensor)
    decision = _decide(node, {a: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs[v] == R


def test_einsum_follows_the_sharded_letter():
    positions, frequencies = torch.randn(16, 3), torch.randn(3, 4, 8)
    node, (p, f) = _node(lambda p, f: torch.einsum("nd,dhf->nhf", p, f), positions, frequencies,
                         target=aten.einsum.default)
    decision = _decide(node, {p: Shard(0)})  # rows of positions: rows of the angles
    assert decision.output == Shard(0) and decision.inputs[f] == R
    decision = _decide(node, {f: Shard(1)})  # heads of the frequencies: heads of the angles
    assert decision.output == Shard(1) and decision.inputs[p] == R
    decision = _decide(node, {p: Shard(1)})  # the summed letter: each rank's part of the sum, the other cut alike
    assert isinstance(decision.output, Partial) and decision.inputs[f] == Shard(0)
    with pytest.raises(Unshardable):
        _decide(node, {p: Shard(0), f: Shard(1)})


def test_indexing_with_one_index_tensor_is_an_index_select():
    node, (x, i) = _node(lambda x, i: x[:, :, i], torch.randn(1, 4, 8, 16), torch.tensor([0, 2, 3, 5]),
                         target=aten.index.Tensor)
    assert _decide(node, {x: Shard(1)}).output == Shard(1)  # heads pass
    with pytest.raises(Unshardable):  # rows picked from a table split along them
        _decide(node, {x: Shard(2)})
    decision = _decide(node, {i: Shard(0)})  # each rank picks its part of the rows from the whole table
    assert decision.output == Shard(2) and decision.inputs[x] == R


def test_an_autocast_region_that_changes_no_dtype_is_inlined():
    from partitioner.frontend.trace import trace

    class RotaryAngles(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frequencies = torch.nn.Parameter(torch.randn(3, 4, 8))

        def forward(self, positions):
            with torch.autocast("cpu", torch.float32):  # (float32 autocast on the CPU: disabled, as in Mochi)
                return torch.einsum("nd,dhf->nhf", positions, self.frequencies).cos()

    model, positions = RotaryAngles(), torch.randn(16, 3)
    traced = trace(model, ((positions,), {}))
    targets = [str(n.target) for n in traced.graph_module.graph.nodes]
    assert "aten.einsum.default" in targets and not any("autocast" in t for t in targets), targets
    assert torch.equal(traced.graph_module(model.frequencies, positions)[0], model(positions))


def test_an_autocast_region_that_casts_stays_whole():
    from partitioner.frontend.trace import trace

    class Bfloat16Matmul(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            with torch.autocast("cpu", torch.bfloat16):  # the matmul runs in bfloat16: inlining would drop that
                return x @ self.weight

    traced = trace(Bfloat16Matmul(), ((torch.randn(4, 8),), {}))
    assert any("autocast" in str(n.target) for n in traced.graph_module.graph.nodes)


def test_autocast_on_the_meta_device_is_traced_when_it_casts_nothing_anywhere():
    """A model on the meta device asking for autocast on its own device (Mochi: ``torch.autocast(x.device.type,
    torch.float32)``): a float32 region over float32 values casts nothing on any device and is inlined; another
    dtype would cast as the device it runs on decides, which a meta trace cannot know: refused."""
    from partitioner.errors import TraceError
    from partitioner.frontend.trace import trace

    class OwnDeviceAutocast(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.frequencies, self.dtype = torch.nn.Parameter(torch.randn(3, 4, 8)), dtype

        def forward(self, positions):
            with torch.autocast(positions.device.type, self.dtype):
                return torch.einsum("nd,dhf->nhf", positions, self.frequencies).cos()

    traced = trace(OwnDeviceAutocast(torch.float32).to("meta"), ((torch.randn(16, 3),), {}))
    assert not any("autocast" in str(n.target) for n in traced.graph_module.graph.nodes)
    with pytest.raises(TraceError, match="autocast region to torch.bfloat16 traced on the meta device"):
        trace(OwnDeviceAutocast(torch.bfloat16).to("meta"), ((torch.randn(16, 3),), {}))


def test_rows_written_into_a_whole_buffer_along_the_split_dim_make_it_packed():
    """``joint[:, :6] = text; joint[:, 6:] = image`` (a joint sequence assembled in place, as Lumina2 does): the
    buffer is laid out in blocks around the written rows, each rank writing its part of them."""
    from partitioner.placement import PackedShard

    node, (buffer, rows) = _node(lambda b, r: aten.slice_scatter(b, r, 1, 6, 22), torch.zeros(1, 22, 4),
                                 torch.randn(1, 16, 4), target=aten.slice_scatter.default)
    decision = _decide(node, {rows: Shard(1)})
    assert decision.output == PackedShard(1, (6, 16)) and decision.inputs[buffer] == PackedShard(1, (6, 16))
    # the other block written into the packed buffer keeps its layout
    node, (buffer, rows) = _node(lambda b, r: aten.slice_scatter(b, r, 1, 0, 6), torch.zeros(1, 22, 4),
                                 torch.randn(1, 6, 4), target=aten.slice_scatter.default)
    assert _decide(node, {buffer: PackedShard(1, (6, 16)), rows: Shard(1)}).output == PackedShard(1, (6, 16))
    with pytest.raises(Unshardable):  # written rows that cut a block of the layout
        _decide(node, {buffer: PackedShard(1, (10, 12)), rows: Shard(1)})
    node, (buffer, rows) = _node(lambda b, r: aten.slice_scatter(b, r, 1, 5, 21), torch.zeros(1, 22, 4),
                                 torch.randn(1, 16, 4), target=aten.slice_scatter.default)
    with pytest.raises(Unshardable):  # blocks of 5 and 1 rows cannot split evenly over 2 ranks
        _decide(node, {rows: Shard(1)})
    node, (batch, joint) = _node(lambda b, j: aten.select_scatter(b, j, 0, 0), torch.zeros(1, 22, 4),
                                 torch.randn(22, 4), target=aten.select_scatter.default)
    decision = _decide(node, {joint: PackedShard(0, (6, 16))})  # (the batch row it is written into)
    assert decision.output == PackedShard(1, (6, 16)) and decision.inputs[batch] == PackedShard(1, (6, 16))


def test_a_constant_index_that_is_one_ascending_run_is_traced_as_a_slice():
    """Rows picked by a constant index (what value specialisation folds Mochi's ``nonzero(mask)`` to, a [rows, 1]
    table then flattened): a slice when the rows are one run, so the rules carry it over whole blocks of a packed
    sequence; any other index stays an index."""
    from partitioner.frontend.trace import trace

    class PicksRows(torch.nn.Module):
        def forward(self, x):
            run = torch.tensor([[1], [2], [3]]).flatten()
            scattered = torch.tensor([0, 2, 3])
            return x[:, run] * 2, x[:, scattered]

    x = torch.randn(2, 6, 3)
    traced = trace(PicksRows(), ((x,), {}))
    targets = [n.target for n in traced.graph_module.graph.nodes]
    assert targets.count(aten.slice.Tensor) == 1 and targets.count(aten.index.Tensor) == 1
    assert sum(gi.kind == "constant" for gi in traced.inputs) == 1  # the run's constant is no longer read
    state = [traced.state[gi.target] for gi in traced.inputs if gi.kind == "constant"]
    got = traced.graph_module(*state, x)
    expected = PicksRows()(x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))

    class MovesItsIndex(torch.nn.Module):  # the constant moved to the input's (meta) device first
        def forward(self, x):
            return x[:, torch.tensor([[1], [2], [3]]).to(x.device).flatten()]

    traced = trace(MovesItsIndex(), ((x.to("meta"),), {}))
    assert [n.target for n in traced.graph_module.graph.nodes if n.op == "call_function"] == [aten.slice.Tensor]

    class PicksFromAScalar(torch.nn.Module):  # (index_select of a 0-d tensor: legal, left alone)
        def forward(self, x):
            return torch.index_select(x.sum(), 0, torch.tensor([0]))

    traced = trace(PicksFromAScalar(), ((x,), {}))
    assert aten.index_select.default in [n.target for n in traced.graph_module.graph.nodes]


@pytest.mark.parametrize("fn, target", [
    (lambda x: x.sort(-1), aten.sort.default),
    (lambda x: x.argsort(-1, descending=True), aten.argsort.default),
    (lambda x: x.argsort(stable=True, dim=-1), aten.argsort.stable),
    (lambda x: x.topk(3, -1), aten.topk.default),
    (lambda x: x.cumsum(-1), aten.cumsum.default),
    (lambda x: x.cummax(-1), aten.cummax.default),
    (lambda x: x.cummin(3), aten.cummin.default),
    (lambda x: x.logcumsumexp(-1), aten.logcumsumexp.default),
])
def test_ops_along_one_dim_carry_a_shard_of_any_other_dim(fn, target):
    """A per-head block map sorted, ranked, cut to its top blocks or accumulated along its last dim (Kandinsky 6 SR's
    NABLA mask): heads split, each rank orders its heads' rows; along the op's own dim it spans the ranks."""
    node, (x,) = _node(fn, torch.randn(1, 4, 6, 6), target=target)
    decision = _decide(node, {x: Shard(1)})
    outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
    assert all(p == Shard(1) for p in outputs) and decision.inputs[x] == Shard(1), decision
    with pytest.raises(Unshardable, match="along the sharded dim 3"):
        _decide(node, {x: Shard(3)})


def test_baddbmm_splits_like_bmm_and_cuts_what_it_adds():
    """diffusers' classic attention scores (``baddbmm(mask, q, k^T)``, batch and heads folded): the folded dim or the
    query rows split as bmm's, the added mask cut alike where it has that dim (of size one it broadcasts: whole);
    a split contraction is refused (every rank would add the mask to its partial product)."""
    node, (m, a, b) = _node(lambda m, a, b: torch.baddbmm(m, a, b, alpha=0.5), torch.randn(6, 1, 5),
                            torch.randn(6, 4, 8), torch.randn(6, 8, 5), target=aten.baddbmm.default)
    decision = _decide(node, {a: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs[b] == Shard(0) and decision.inputs[m] == Shard(0)
    decision = _decide(node, {a: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs[b] == R and decision.inputs[m] == R
    with pytest.raises(Unshardable, match="contracted"):
        _decide(node, {a: Shard(2), b: Shard(1)})
