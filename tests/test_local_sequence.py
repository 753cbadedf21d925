"""The packed sequence built locally (``passes/gather_scatters``): a sequence scattered together with index_copy is
rewritten as a gather of rows, so each rank of a sequence axis builds and projects only the rows it owns.

Exactness of every layout on H3 (whose packed sequence is built this way) is checked rank by rank in
test_ring.py and test_ulysses_numerics.py; here: the rewrite itself against the unrewritten graph, that no rank
holds the whole packed hidden sequence (with a negative control: without the rewrite the check fails), and the
measured per-rank peak memory against the single device and against the report's estimate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partitioner
from partitioner.passes.context import PassContext
from partitioner.mesh import as_mesh_spec
from partitioner.passes import gather_scatters
from partitioner.testing import (TINY_H3, fake_mesh, h3_inputs, peak_allocated_bytes, run_ranks, tiny_h3,
                                 traced_peak_bytes)
from partitioner.frontend.trace import trace
from partitioner.annotations import annotation

aten = torch.ops.aten
HIDDEN, HEADS = 16, 2


class Packed(nn.Module):
    """Two modalities projected (one through broadcast elementwise ops) and scattered into one sequence."""

    def __init__(self):
        super().__init__()
        self.proj_a, self.proj_b = nn.Linear(6, HIDDEN), nn.Linear(4, HIDDEN)
        self.scale = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, a, b, index_a, index_b):
        packed = a.new_zeros((1, index_a.numel() + index_b.numel(), HIDDEN))
        packed = packed.index_copy(1, index_a, self.proj_a(a) * self.scale)
        packed = packed.index_copy(1, index_b, torch.relu(self.proj_b(b)) + 1.0)
        q = packed.unflatten(-1, (HEADS, -1)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


def _packed_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(11, generator=g)
    return dict(a=torch.randn(1, 7, 6, generator=g), b=torch.randn(1, 4, 4, generator=g), index_a=order[:7],
                index_b=order[7:])


def _rewritten(model, inputs: dict, mesh: dict):
    """``model``'s traced graph after gather_scatters (its postcondition checked), and the arguments to call it."""
    traced = trace(model, ((), inputs))
    ctx = PassContext(as_mesh_spec(mesh), traced.inputs)
    gm = gather_scatters.run(traced.graph_module, ctx)
    gather_scatters.check(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    values = list(inputs.values())
    return gm, [traced.state[gi.target] if gi.kind != "user" else values[gi.target] for gi in traced.inputs]


def test_scatter_becomes_gather_of_projected_rows():
    """The rewrite computes the same values; each projection reads its rows picked from its latent input (through
    the broadcast scale and the relu + 1), and no index_copy into the sequence is left. Without a sequence axis the
    graph is unchanged."""
    torch.manual_seed(0)
    model, inputs = Packed().eval(), _packed_inputs()
    gm, args = _rewritten(model, inputs, {"ulysses": 2})
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert [n.args[0].target for n in linears] == [aten.index_select.default] * 2
    assert all(n.args[0].args[0].op == "placeholder" for n in linears)  # the latent inputs themselves
    writes = [n for n in gm.graph.nodes if n.target is aten.index_copy.default]
    assert all(n.args[0].target is aten.full.default for n in writes)  # only the per-row owner tables
    with torch.no_grad():
        torch.testing.assert_close(gm(*args)[0], model(**inputs), rtol=0, atol=1e-6)

    unchanged = trace(model, ((), inputs))
    before = str(unchanged.graph_module.graph)
    gather_scatters.run(unchanged.graph_module, PassContext(as_mesh_spec({"tp": 2}), unchanged.inputs))
    assert str(unchanged.graph_module.graph) == before


class Scatter(nn.Module):
    """One index_copy into a sequence along ``dim`` (given negative), its source computed by ``source``; an
    attention reads the result."""

    def __init__(self, source: str):
        super().__init__()
        self.source, self.proj, self.last = source, nn.Linear(6, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, buffer, rows, index):
        if self.source == "through a view":  # moves through the linear over the last dim, stops at the transposes
            source = self.last(self.proj(rows).transpose(-1, -2).transpose(-1, -2))
        elif self.source == "two users":  # the projection is also read elsewhere: the selection stays after it
            projected = self.proj(rows)
            source = projected + projected.sum()
        else:
            source = self.proj(rows)
        packed = buffer.index_copy(-2, index, source)
        q = packed.unflatten(-1, (HEADS, -1)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("case", ["batch 3", "duplicates", "one row", "empty", "through a view", "two users"])
def test_scatter_to_gather_edge_cases(case):
    """The rewrite against index_copy itself: a batch of 3, duplicate indices, a one-row and an empty source, a
    negative dim; the selection moves through row-wise ops (not views it does not know) only while it is their sole
    use, and not from a one-row value (whose size-1 operands would pass for broadcast ones)."""
    torch.manual_seed(0)
    batch, count = (3 if case == "batch 3" else 1), {"one row": 1, "empty": 0}.get(case, 5)
    index = torch.tensor([2, 7, 2, 4, 9]) if case == "duplicates" else torch.randperm(11)[:count]
    inputs = dict(buffer=torch.randn(batch, 11, HIDDEN), rows=torch.randn(batch, count, 6), index=index)
    model = Scatter(case).eval()
    gm, args = _rewritten(model, inputs, {"ring": 2})
    with torch.no_grad():
        torch.testing.assert_close(gm(*args)[0], model(**inputs), rtol=0, atol=1e-6)
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    picked_first = [n.args[0].target is aten.index_select.default for n in linears]
    expected = {"empty": [False], "one row": [False], "two users": [False],
                "through a view": [False, True]}.get(case, [True])
    assert picked_first == expected
    assert not any(n.target is aten.index_copy.default and not annotation(n).row_owners for n in gm.graph.nodes)


def _whole_packed_values(partitioned, packed_rows: int, hidden: int) -> list[str]:
    """Values of this rank that hold every row of the packed sequence at the model's hidden width."""
    return [n.name for n in partitioned.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3
            and tuple(n.meta["val"].shape[1:]) == (packed_rows, hidden)]


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 3}])
def test_no_rank_holds_the_packed_sequence(layout, monkeypatch):
    """Tiny H3 (25 packed rows): the packed buffer, each modality's rows and every block activation are this
    rank's rows only; the per-row owner tables (integers) are the only whole-sequence values before the output
    heads. Negative control: without the rewrite every rank builds the whole packed sequence."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3, video=13, audio=7)
    names, shape = tuple(layout), tuple(layout.values())
    with fake_mesh(shape, names, 0) as mesh:
        partitioned = partitioner.partition(model, mesh, ((), inputs))
        assert _whole_packed_values(partitioned, 25, TINY_H3["hidden_size"]) == []
        monkeypatch.setattr(gather_scatters, "_scatters", lambda gm, ctx: [])
        whole = partitioner.partition(model, mesh, ((), inputs))
        assert len(_whole_packed_values(whole, 25, TINY_H3["hidden_size"])) >= 3  # the buffer and its copies


SMALL = dict(num_attention_heads=4, attention_head_dim=32, hidden_size=128, num_layers=2, num_refiner_layers=1,
             ffn_dim=64, in_channels=8, audio_in_channels=16, patch_size=(1, 2, 2), text_dim=128, freq_dim=64,
             time_embed_hidden_dim=128, time_embed_dim=64, rope_freq_dim=4)
ROWS = dict(text=32, video=4000, audio=64)  # 4096 packed rows


def _memory(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, inputs = tiny_h3(**SMALL), h3_inputs(SMALL, **ROWS)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("tp", "ulysses"))
    results = dict(single=traced_peak_bytes(model, inputs))
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
        for name, scatters in (("local", gather_scatters._scatters), ("whole", lambda gm, ctx: [])):
            gather_scatters._scatters, original = scatters, gather_scatters._scatters
            try:
                partitioned = partitioner.partition(model, mesh, ((), inputs))
            finally:
                gather_scatters._scatters = original
            compiled = partitioned.compile()
            results[f"{name} error"] = (compiled(**inputs, return_dict=False)[0] - expected).abs().max().item()
            # the least of five: a collective's buffer released by gloo's thread is never seen freed (the profiler
            # records this thread's frees), so under load a pass can read high, never low
            results[name] = min(peak_allocated_bytes(lambda: compiled(**inputs, return_dict=False))
                                for _ in range(5))
            results[f"{name} estimate"] = partitioned.report().activation_peak_bytes
    return results


def test_measured_peak_falls_when_each_rank_builds_its_rows():
    """TP=2 x Ulysses=2 on a small H3 (4096 packed rows, hidden 128, narrow feed-forwards so that building the packed
    sequence matters), gloo ranks, every rank exact. Measured per-rank peak (the CPU allocator's, one forward pass):
    below 0.9 of the peak when every rank builds the whole packed sequence (the negative control: the rewrite is
    what cuts it; measured 0.77 on an idle machine, 0.87 seen under load; the report estimates 0.69), and at most
    half the single-device graph's. The report's estimate
    stays within a factor of 2 of the measured peak (it models values, not kernel temporaries or allocator
    rounding; measured here within 15%)."""
    for result in run_ranks(4, _memory):
        assert result["local error"] < 1e-5 and result["whole error"] < 1e-5, result
        assert result["local"] < 0.9 * result["whole"], result
        assert result["local"] <= 0.5 * result["single"], result
        assert result["local estimate"] < 0.85 * result["whole estimate"], result
        for name in ("local", "whole"):
            assert 0.5 <= result[f"{name} estimate"] / result[name] <= 2.0, result
