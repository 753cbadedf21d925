"""Writes in place on sharded values: the trace is functionalized, so every write is carried exactly or the value is
left whole; never a collective or slice that reads a value before a write it should see.

Tolerance as in test_tp_numerics: float32, sharding reorders sums only, 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import partition
from partitioner.testing import (cogvideox_inputs, cogview4_inputs, run_ranks, tiny_cogvideox, tiny_cogview4)

TOLERANCE = 1e-5
PATTERNS = ("copy_", "slice_assign", "index_put_", "add_", "out_variant", "view_write")


class InPlaceAttention(nn.Module):
    """4 heads x 8 over 7 rows, with one write in place on q, k or v between the projections and the attention."""

    def __init__(self, pattern: str, heads: int = 4, dim: int = 32):
        super().__init__()
        self.pattern, self.heads = pattern, heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, angle):
        b, s, _ = x.shape
        projected = self.q(x)
        if self.pattern == "view_write":  # a write into the projection before it is split into heads
            projected[:, :, : projected.shape[-1] // 2] *= 2.0
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (projected, self.k(x), self.v(x)))
        if self.pattern == "copy_":  # rotary written as copy_ into a strided slice
            half = angle[:, 0::2]
            q[..., 0::2].copy_(q[..., 0::2] * half.cos() - q[..., 1::2] * half.sin())
        elif self.pattern == "slice_assign":  # diffusers' CogVideoX: rotate the rows after the text
            k[:, :, 2:] = k[:, :, 2:] * angle.cos()[2:]
        elif self.pattern == "index_put_":
            rows = torch.arange(0, s, 2)
            q[:, :, rows] = q[:, :, rows] * 0.5
        elif self.pattern == "add_":
            k.add_(angle.sin())
        elif self.pattern == "out_variant":
            v = torch.mul(v, angle.cos(), out=torch.empty_like(v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).flatten(2))


def _pattern_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(1, 7, 32, generator=g), angle=torch.randn(7, 8, generator=g))


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _patterns_on_ranks(rank, world, shape, names):
    errors = {}
    for pattern in PATTERNS:
        torch.manual_seed(0)
        model, inputs = InPlaceAttention(pattern).eval(), _pattern_inputs()
        with torch.no_grad():
            expected = model(**inputs)
        partitioned = partition(model, _mesh(shape, names), ((), inputs))
        errors[pattern] = ((partitioned.compile()(**inputs) - expected).abs().max().item(),
                           dict(partitioned.collective_counts()))
    return errors


@pytest.mark.parametrize("shape, names", [((2,), ("ulysses",)), ((2,), ("tp",))], ids=["ulysses2", "tp2"])
def test_every_write_pattern_is_exact_on_every_rank(shape, names):
    for errors in run_ranks(2, _patterns_on_ranks, shape, names):
        for pattern, (error, collectives) in errors.items():
            assert error <= TOLERANCE, (pattern, error)
            assert collectives, (pattern, "nothing was sharded: the test would not exercise the write")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_trace_has_no_write_in_place_left(pattern):
    from partitioner.frontend.trace import trace

    traced = trace(InPlaceAttention(pattern).eval(), ((), _pattern_inputs()))
    mutable = [n for n in traced.graph_module.graph.nodes
               if getattr(getattr(n.target, "_schema", None), "is_mutable", False)]
    assert mutable == []


def test_graphs_without_writes_are_not_rewritten():
    """Functionalization only runs where it is needed: it rewrites views (unflatten -> view) and costs seconds."""
    from partitioner.frontend.trace import trace

    traced = trace(InPlaceAttention("none").eval(), ((), _pattern_inputs()))
    targets = {n.target for n in traced.graph_module.graph.nodes}
    assert torch.ops.aten.unflatten.int in targets and torch.ops.aten.slice_scatter.default not in targets


class _AppendedRows(nn.Module):
    def forward(self, x, rest):
        n = x.shape[0]
        return torch.cat([x * 2, x[n:]]) * 3, torch.cat([x, rest[n:]]) + 1


def test_operands_empty_along_the_concatenated_dim_are_dropped_unless_they_decide_the_dtype():
    """``cat([y, x[n:]])`` with ``x[n:]`` empty is ``y`` (the slice gone with it); an empty float64 operand that
    makes a float32 concatenation float64 stays: dropping it would change the result's dtype."""
    from partitioner.frontend.trace import trace

    x, rest = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    traced = trace(_AppendedRows(), ((x, rest), {}))
    cats = [n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert [len(n.args[0]) for n in cats] == [2] and cats[0].meta["val"].dtype == torch.float64
    for actual, expected in zip(traced.graph_module(x, rest), _AppendedRows()(x, rest)):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)


class _ViewsTheConcatenation(nn.Module):
    def forward(self, x):
        y = x.transpose(0, 1)
        return torch.cat([y, y[y.shape[0]:]]).view(-1) * 2


def test_a_concatenation_left_with_one_transposed_operand_still_copies_it():
    """Its copy is laid out as the view after it was traced for (review finding: replaced by the transposed operand,
    the view failed; an as_strided would read the wrong elements)."""
    from partitioner.frontend.trace import trace

    x = torch.randn(8, 4)
    traced = trace(_ViewsTheConcatenation(), ((x,), {}))
    assert torch.equal(traced.graph_module(x)[0], _ViewsTheConcatenation()(x))


def test_the_rank_program_copies_no_activation_the_model_did_not_copy():
    """Functionalization turns each eval-mode dropout into a clone (Wan: 6 of its 8 clones; a Flux graph without
    writes keeps its 6 dropouts as ops): a copy of an activation per call that no rank needs. What stays is what
    the model asks for: a clone that makes a transposed value contiguous (Wan's rotary), which the partition
    keeps exactly."""
    from partitioner.testing.zoo import build, inputs

    for name in ("wan", "flux"):
        partitioned = partition(build(name), {"ulysses": 2}, inputs(name), rank=0)
        nodes = list(partitioned.graph_module.graph.nodes)
        assert not [n for n in nodes if n.target is torch.ops.aten.dropout.default], name
        for clone in [n for n in nodes if n.target is torch.ops.aten.clone.default]:
            assert clone.kwargs.get("memory_format") is torch.contiguous_format, (name, clone.format_node())


def test_an_op_that_writes_in_place_is_never_carried():
    """Rules never carry an in-place op (a pointwise tag is not enough: add_ has one)."""
    from partitioner.placement import Shard
    from partitioner.rules import Unshardable, rule_for

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    add_ = graph.call_function(torch.ops.aten.add_.Tensor, (x, 1.0))
    add_.meta["val"] = torch.empty(4, 8)
    with pytest.raises(Unshardable, match="no sharding rule"):
        rule_for(add_)(add_, {x: Shard(0)}, 2)


def _unguarded_copy_under_ulysses(rank, world):
    """Negative control: the old behaviour (no functionalization, in-place ops carried as pointwise) is wrong."""
    import sys

    import partitioner.rules as rules
    import partitioner.frontend.trace as trace

    trace.functionalize = lambda program, owner: program
    original = rules.rule_for

    def carried(node, *args, **kwargs):
        if node.target is torch.ops.aten.copy_.default:
            return rules.pointwise
        return original(node, *args, **kwargs)

    for module in list(sys.modules.values()):  # every planner that imported rule_for
        if getattr(module, "rule_for", None) is original:
            module.rule_for = carried
    torch.manual_seed(0)
    model, inputs = InPlaceAttention("copy_").eval(), _pattern_inputs()
    with torch.no_grad():
        expected = model(**inputs)
    compiled = partition(model, _mesh((world,), ("ulysses",)), ((), inputs)).compile()
    return (compiled(**inputs) - expected).abs().max().item()


def test_negative_control_carrying_the_write_unseen_is_wrong():
    assert max(run_ranks(2, _unguarded_copy_under_ulysses)) > 1e-3


def _diffusers_models(rank, world, shape, names):
    results = {}
    for name, build, make_inputs in (("cogvideox", tiny_cogvideox, cogvideox_inputs),
                                     ("cogview4", tiny_cogview4, cogview4_inputs)):
        model = build()
        inputs = dict(make_inputs(model), return_dict=False)
        with torch.no_grad():
            expected = model(**inputs)[0]
        partitioned = partition(model, _mesh(shape, names), ((), inputs))
        results[name] = ((partitioned.compile()(**inputs)[0] - expected).abs().max().item(),
                         partitioned.collective_counts()[("all_to_all", "ulysses")])
    return results


@pytest.mark.parametrize("shape, names", [((2,), ("ulysses",)), ((2, 2), ("tp", "ulysses"))],
                         ids=["ulysses2", "tp2xulysses2"])
def test_cogvideox_and_cogview4_rotate_in_place_and_stay_exact(shape, names):
    """diffusers' CogVideoX (rotary) and CogView4 write the rotated rows into q and k in place."""
    for results in run_ranks(len(shape) * 2 if len(shape) == 2 else 2, _diffusers_models, shape, names):
        for name, (error, exchanges) in results.items():
            assert error <= TOLERANCE, (name, error)
            assert exchanges > 0, (name, "no attention was sequence-sharded")


class _Table:
    """A helper object a model holds (Z-Image's RopeEmbedder): it caches a table on its first call."""

    def __init__(self):
        self.table = None

    def __call__(self, n: int, device) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(n, dtype=torch.float32, device=device) * 0.5
        return self.table


class _CachesOnFirstCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.table, self.scale = nn.Linear(8, 8), _Table(), None

    @staticmethod
    @functools.lru_cache(maxsize=8)  # (NucleusMoE's rotary tables are cached so)
    def angles(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) * 0.25

    def forward(self, x):
        if self.scale is None:  # its own attribute, set on the first call
            self.scale = x.new_full((), 2.0)
        return self.linear(x) * self.scale + self.table(x.shape[-1], x.device) + self.angles(x.shape[-1])


def test_tracing_leaves_the_model_as_it_found_it():
    """A forward that caches on its first call kept what the trace computed from fake tensors: called eagerly
    afterwards, the user's model returned other numbers (Z-Image by 0.4, its rotary tables) or failed, and a second
    trace took the cached fake tensors for constants. The trace restores every module's plain attributes and those
    of the helper objects they hold, and empties their classes' method caches."""
    from partitioner import plan

    torch.manual_seed(0)
    model, x = _CachesOnFirstCall().eval(), torch.randn(2, 8)
    plan(model, {"tp": 2}, ((x,), {}))
    assert model.scale is None and model.table.table is None
    with torch.no_grad():
        assert torch.equal(model(x), model.linear(x) * 2.0 + torch.arange(8.0) * 0.5 + torch.arange(8.0) * 0.25)
    plan(model, {"ulysses": 2}, ((x,), {}))  # a second trace of the same model
