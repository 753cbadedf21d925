"""No failure inside tracing, planning, localizing or lowering escapes as a raw builtin, and the class of bug that
once did: a partial sum split along the features its linear's bias spans.

A timestep MLP (Linear -> SiLU -> Linear on a [1, 32] embedding) whose output is added to a feature-sharded value
(a column-parallel projection of the pooled text, normed across ranks, as Kandinsky 5 builds its time embedding)
is reduce-scattered along its features; the bias that ``insert_collectives`` moves after the sum must then be this
rank's slice of it. Before that rule the rank program crashed in ``localize`` ("Attempting to broadcast a dimension
of length 32 at -1! ... broadcastable to [1, 16]"). Checked exact on gloo ranks in TP=2, Ulysses=2 and TP=2 x
Ulysses=2 against the single-device model (float32, 1e-5 of the output's magnitude), with a negative control
(the bias added whole on every rank's half misses).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partitioner
from partitioner.errors import BackendError, InvariantError
from partitioner.runtime import collectives
from partitioner.testing import broken_rule, fake_mesh, run_ranks


class Block(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.ff1, self.ff2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width, elementwise_affine=False)

    def forward(self, x, shift, scale):
        b, n, d = x.shape
        y = self.norm(x) * (1 + scale) + shift
        q, k, v = (p(y).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.ff2(F.gelu(self.ff1(self.norm(x))))


class TimestepMLPModel(nn.Module):
    """The time embedding: a row-parallel MLP output (with its bias) plus a feature-sharded pooled-text value."""

    def __init__(self, time: int = 32, width: int = 64):
        super().__init__()
        self.t_in, self.t_out = nn.Linear(time, time), nn.Linear(time, time)
        self.pooled, self.pooled_norm = nn.Linear(16, time), nn.LayerNorm(time)
        self.modulation = nn.Linear(time, 2 * width)
        self.inp, self.block, self.out = nn.Linear(8, width), Block(width), nn.Linear(width, 8)

    def forward(self, x, t, pooled):
        temb = self.t_out(F.silu(self.t_in(t))) + self.pooled_norm(self.pooled(pooled))
        shift, scale = self.modulation(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        return self.out(self.block(self.inp(x), shift, scale))


def _model_and_inputs():
    torch.manual_seed(0)
    model = TimestepMLPModel().eval()
    return model, dict(x=torch.randn(1, 9, 8), t=torch.randn(1, 32), pooled=torch.randn(1, 16))


def _bias_adds(partitioned) -> list:
    """(the bias add after a reduce-scatter, whether it reads a slice of the bias) in this rank's program."""
    found = []
    for node in partitioned.graph_module.graph.nodes:
        if node.target is torch.ops.aten.add.Tensor and getattr(node.args[0], "target", None) is \
                collectives.reduce_scatter_wait:
            found.append(node.args[1].target is torch.ops.aten.slice.Tensor)
    return found


def _lowered_with_a_broken_backend(partitioned) -> str:
    """What ``lower`` raises when the eager backend's lowering fails with a raw builtin."""
    import dataclasses

    from partitioner.backends import BACKENDS

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a backend bug")

    original = BACKENDS["eager"]
    BACKENDS["eager"] = dataclasses.replace(original, lower=broken)
    try:
        partitioned.lower("eager")
        return "returned"
    except BackendError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001  (what the test must not see)
        return f"raw {type(error).__name__}"
    finally:
        BACKENDS["eager"] = original


def _case(rank: int, world: int, shape: tuple, names: tuple) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = _model_and_inputs()
    with torch.no_grad():
        expected = model(**inputs)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs),
                                        overlap=False)
    result = dict(error=float((partitioned.compile()(**inputs) - expected).abs().max()),
                  scale=float(expected.abs().max()), bias_adds=_bias_adds(partitioned))
    if "tp" in names:  # negative control: the bias's other half added to this rank's features
        sliced = next(n.args[1] for n in partitioned.graph_module.graph.nodes if n.target is torch.ops.aten.add.Tensor
                      and getattr(n.args[1], "target", None) is torch.ops.aten.slice.Tensor
                      and getattr(n.args[0], "target", None) is collectives.reduce_scatter_wait)
        whole, dim, start, end = sliced.args
        other = (start + end - start) % whole.meta["val"].shape[0]
        sliced.args = (whole, dim, other, other + end - start)
        partitioned.graph_module.recompile()
        result["control"] = float((partitioned.compile()(**inputs) - expected).abs().max())
        result["lowering"] = _lowered_with_a_broken_backend(partitioned)
    return result


@pytest.mark.parametrize("shape,names", [((2,), ("tp",)), ((2,), ("ulysses",)), ((2, 2), ("tp", "ulysses"))],
                         ids=["tp2", "ulysses2", "tp2xulysses2"])
def test_a_sum_split_along_its_bias_features_meets_the_bias_sliced_alike(shape, names):
    import math

    results = run_ranks(math.prod(shape), _case, shape, names)
    for rank, result in enumerate(results):
        assert result["error"] <= 1e-5 * max(result["scale"], 1.0), (rank, result)
        if "tp" in names:
            assert True in result["bias_adds"], result  # the rule under test ran: a bias sliced after a scatter
            assert result["control"] > 1e-3, result
            assert result["lowering"].startswith("lowering to backend 'eager' failed"), result
            assert "ZeroDivisionError: a backend bug" in result["lowering"], result


def test_a_pass_that_fails_raw_is_an_invariant_error_naming_pass_node_op_and_line():
    model, inputs = _model_and_inputs()

    def raw(node, visible, axis_size):
        raise ZeroDivisionError("a rule bug")

    with broken_rule(torch.ops.aten.silu.default, raw), fake_mesh((2,), ("tp",), 0) as mesh, \
            pytest.raises(InvariantError) as caught:
        partitioner.plan(model, mesh, ((), inputs))
    message = str(caught.value)
    assert message.startswith("pass plan_sharding failed at silu (silu.default, from "), message
    assert "test_no_raw_errors.py" in message and "ZeroDivisionError: a rule bug" in message, message


def test_a_trace_clean_up_that_fails_raw_is_an_invariant_error(monkeypatch):
    from partitioner.frontend import trace as trace_module

    model, inputs = _model_and_inputs()

    def raw(gm):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                raise IndexError("a clean-up bug")

    monkeypatch.setattr(trace_module, "clean_export_graph", raw)
    with pytest.raises(InvariantError) as caught:
        trace_module.trace(model, ((), inputs))
    message = str(caught.value)
    assert message.startswith("trace (the exported graph's clean-up) failed at "), message
    assert "IndexError: a clean-up bug" in message, message


def test_an_inductor_compilation_that_fails_raw_is_a_backend_error(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    from partitioner.backends import inductor

    def raw(*args, **kwargs):
        raise RuntimeError("an inductor bug")

    monkeypatch.setattr(compile_fx, "compile_fx", raw)
    run = inductor.lower(torch.fx.symbolic_trace(nn.Linear(2, 2)), regional=False)
    with pytest.raises(BackendError, match="lowering to backend 'inductor' failed: RuntimeError: an inductor bug"):
        run(torch.randn(1, 2))


def test_an_op_sized_by_values_known_at_trace_keeps_its_size_when_propagated_again():
    """QwenImage-2.1 repeats its text rows by a tensor of repeats whose values the trace knew (a mask specialised
    under value guards): export gave the result a static size, and every later fake propagation (localize's, per
    rank) must take that size rather than fail in fake ``repeat_interleave`` (was: InvariantError in localize)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partitioner.passes.regions import propagate_fake_values

    graph = torch.fx.Graph()
    rows, repeats = graph.placeholder("rows"), graph.placeholder("repeats")
    repeated = graph.call_function(torch.ops.aten.repeat_interleave.self_Tensor, (rows, repeats, 1))
    graph.output(graph.call_function(torch.ops.aten.relu.default, (repeated,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode()
    with mode:
        inputs = [torch.empty(1, 3, 8), torch.empty(3, dtype=torch.int64)]
        repeated.meta["val"] = torch.empty(1, 5, 8)  # as the trace left it (repeats [2, 1, 2])
    propagate_fake_values(gm, mode, inputs)
    assert tuple(repeated.meta["val"].shape) == (1, 5, 8)
    assert tuple(next(iter(repeated.users)).meta["val"].shape) == (1, 5, 8)
    propagate_fake_values(gm, mode, inputs, shape_of=lambda node: (1, 5, 4) if node is repeated else None)
    assert tuple(repeated.meta["val"].shape) == (1, 5, 4)  # (localize: the global size cut by its placements)


class EmptyFaceKeys(nn.Module):
    """WanAnimate without a face: keys and values of zero rows joined to the image's, split into heads by a view
    (was: annotate_heads' head_dim-based view [1, 0, -1, 4], ambiguous over zero elements: InvariantError)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.face_k, self.face_v, self.o = (nn.Linear(8, 8) for _ in range(6))

    def forward(self, x, face):
        def heads(y):
            return y.view(1, y.shape[1], 2, 4).transpose(1, 2)
        keys = torch.cat([heads(self.k(x)), heads(self.face_k(face))], 2)
        values = torch.cat([heads(self.v(x)), heads(self.face_v(face))], 2)
        return self.o(F.scaled_dot_product_attention(heads(self.q(x)), keys, values).transpose(1, 2).flatten(2))


def _empty_face_keys(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model, inputs = EmptyFaceKeys().eval(), dict(x=torch.randn(1, 5, 8), face=torch.randn(1, 0, 8))
    partitioned = partitioner.partition(model, mesh, ((), inputs))
    assert partitioned.ctx.slice_specs  # (heads split: the face projections are column-parallel too)
    return float((partitioned.compile()(**inputs) - model(**inputs)).abs().max())


def test_heads_split_from_an_empty_value_partition_exactly():
    assert max(run_ranks(2, _empty_face_keys)) < 1e-6
