"""Unit tests of each pass on tiny synthetic graphs, planned for a {"tp": 2} mesh without process groups."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import partitioner
from partitioner.runtime import collectives
from partitioner.passes.context import PassContext
from partitioner.mesh import as_mesh_spec
from partitioner.passes import annotate_heads, plan_sharding
from partitioner.placement import PackedShard, Partial, Replicate, Shard, is_sharded, shard_slices, slice_local
from partitioner.rules import PartitionError, view_groups as _view_groups
from partitioner.frontend.trace import trace
from partitioner.annotations import annotation

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
D, F_DIM, HEADS = 32, 64, 4


# --- tiny models -------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, dim=D, heads=HEADS, old_style=False):
        super().__init__()
        self.heads, self.old_style = heads, old_style
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def split(self, h):
        if self.old_style:  # diffusers' older processors: view by the configured head count
            return h.view(h.shape[0], -1, self.heads, h.shape[-1] // self.heads).transpose(1, 2)
        return h.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        out = F.scaled_dot_product_attention(*(self.split(p(x)) for p in (self.to_q, self.to_k, self.to_v)))
        out = out.transpose(1, 2)
        return self.to_out(out.reshape(*out.shape[:2], -1) if self.old_style else out.flatten(2))


class MLP(nn.Module):
    def __init__(self, dim=D, ffn=F_DIM):
        super().__init__()
        self.up, self.down = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, **attn):
        super().__init__()
        self.attn, self.mlp = Attention(**attn), MLP()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class FusedSwiGLU(nn.Module):
    def __init__(self, dim=D, ffn=F_DIM):
        super().__init__()
        self.proj, self.down = nn.Linear(dim, 2 * ffn), nn.Linear(ffn, dim)

    def forward(self, x):
        value, gate = self.proj(x).chunk(2, -1)
        return self.down(value * F.silu(gate))


class LlamaMLP(nn.Module):
    def __init__(self, dim=D, ffn=F_DIM):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class NormMLP(MLP):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(F_DIM)

    def forward(self, x):
        return self.down(self.norm(F.gelu(self.up(x))))


class AdaTable(nn.Module):
    """Few rows (one per timestep), many features; ``normed`` puts a norm over the output features after it."""
    def __init__(self, normed=False):
        super().__init__()
        self.normed, self.linear = normed, nn.Linear(256, 1024)

    def forward(self, t):
        return F.layer_norm(self.linear(t), (1024,)) if self.normed else self.linear(t)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def x_in():
    return {"x": torch.randn(2, 6, D, generator=torch.Generator().manual_seed(0))}


def t_in():
    return {"t": torch.randn(2, 256, generator=torch.Generator().manual_seed(0))}


def part(model, kwargs=None, *, rank=0, plan=None):
    return partitioner.partition(model.eval(), {"tp": 2}, ((), kwargs or x_in()), plan=plan, rank=rank)


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def ancestors(node, seen=None):
    seen = set() if seen is None else seen
    for n in node.all_input_nodes:
        if n not in seen:
            seen.add(n)
            ancestors(n, seen)
    return seen


def run_graph(gm, inputs, state, user_args):
    """Call a partition's GraphModule directly (only valid without collectives): state tensors, then user inputs."""
    return gm(*[state[gi.target] if gi.kind != "user" else user_args[gi.target] for gi in inputs])


def annotated(model, kwargs):
    traced = trace(model.eval(), ((), kwargs))
    ctx = PassContext(as_mesh_spec({"tp": 2}), traced.inputs)
    return traced, annotate_heads.run(traced.graph_module, ctx), ctx


# --- 1. annotate_heads -------------------------------------------------------------------------------------------

def test_annotate_heads_unflatten_becomes_head_dim_based():
    """unflatten(-1, (heads, -1)) becomes unflatten(-1, [-1, head_dim]); sdpa and projections carry HeadInfo."""
    _, gm, ctx = annotated(Block(), x_in())
    splits = nodes(gm, aten.unflatten.int)
    assert len(splits) == 3 and all(list(n.args[2]) == [-1, D // HEADS] for n in splits)
    assert {annotation(n).heads.role for n in splits} == {"q", "k", "v"}
    (sdpa,) = nodes(gm, aten.scaled_dot_product_attention.default)
    info = annotation(sdpa).heads
    assert (info.heads, info.head_dim, info.role, info.module) == (HEADS, D // HEADS, "attention", "attn")
    roles = {n.args[1].name: annotation(n).heads for n in nodes(gm, aten.linear.default)
             if annotation(n).heads is not None}
    assert {name: h.role for name, h in roles.items()} == {
        "p_attn_to_q_weight": "q", "p_attn_to_k_weight": "k", "p_attn_to_v_weight": "v", "p_attn_to_out_weight": "out"}
    assert all((h.heads, h.head_dim, h.attention) == (HEADS, D // HEADS, sdpa.name) for h in roles.values())
    assert ctx.attention == [info]


def test_annotate_heads_old_view_infers_head_count():
    """view(B, -1, heads, head_dim) is rewritten to infer the head count (-1) and keep head_dim."""
    _, gm, _ = annotated(Block(old_style=True), x_in())
    splits = [n for n in nodes(gm, aten.view.default) if annotation(n).heads is not None]
    assert len(splits) == 3
    for split in splits:
        sizes = list(split.args[1])
        assert sizes[-2:] == [-1, D // HEADS] and sizes.count(-1) == 1, sizes
        assert annotation(split).heads.heads == HEADS


@pytest.mark.parametrize("old_style", [False, True])
def test_annotate_heads_preserves_the_function(old_style):
    """On full-size tensors the rewritten graph computes what the model computes."""
    model, kwargs = Block(old_style=old_style).eval(), x_in()
    traced, gm, ctx = annotated(model, kwargs)
    (out,) = run_graph(gm, ctx.inputs, traced.state, [kwargs["x"]])
    torch.testing.assert_close(out, model(**kwargs))


@pytest.mark.parametrize("old_style", [False, True])
def test_heads_not_divisible_by_degree_split_whole(old_style):
    """3 heads of 16 over tp=2: rank 0 holds 2 heads, rank 1 one; the q/k/v weights are cut at head boundaries."""
    for rank, heads in ((0, 2), (1, 1)):
        p = part(Attention(dim=48, heads=3, old_style=old_style), {"x": torch.randn(1, 5, 48)}, rank=rank)
        assert p.linear_styles["to_q"] == "colwise uneven 16-32 in units of 16"
        assert p.slice_specs["to_q.weight"] == {"tp": PackedShard(0, (48,), 16)}
        (attention,) = nodes(p.graph_module, aten.scaled_dot_product_attention.default)
        assert attention.meta["val"].shape[1] == heads


def test_tp_degree_above_heads_raises():
    """More tp ranks than heads: a PartitionError naming the attention, the largest degree and other meshes."""
    with pytest.raises(PartitionError, match=r"3 attention heads .* largest tp degree is 3.*'tp': 2, 'ulysses': 2"):
        partitioner.partition(Attention(dim=48, heads=3).eval(), {"tp": 4}, ((), {"x": torch.randn(1, 5, 48)}))


# --- 2. plan_sharding --------------------------------------------------------------------------------------------

def test_plan_mlp_colwise_then_rowwise():
    """up -> gelu -> down: up column-wise (weight and bias cut on dim 0), down row-wise (weight cut on dim 1)."""
    p = part(MLP())
    assert p.linear_styles == {"up": "colwise", "down": "rowwise"}
    assert p.slice_specs == {"up.weight": {"tp": Shard(0)}, "up.bias": {"tp": Shard(0)},
                             "down.weight": {"tp": Shard(1)}}
    assert p.explain("up") == "up: colwise"


def test_plan_sharding_placements_per_node():
    """After plan_sharding alone, the up output is Shard(-1), the activation follows it and down is Partial."""
    _, gm, ctx = annotated(MLP(), x_in())
    gm = plan_sharding.run(gm, ctx)
    up, down = nodes(gm, aten.linear.default)
    (gelu,) = nodes(gm, aten.gelu.default)
    assert annotation(up).placements == {"tp": Shard(2)} and annotation(gelu).placements == {"tp": Shard(2)}
    assert annotation(down).placements == {"tp": Partial()}
    assert annotation(down).required["tp"][gelu] == Shard(2)
    assert all("tp" in annotation(n).placements for n in gm.graph.nodes)


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_fused_swiglu_is_packed(rank):
    """[value; gate] from one chunked Linear is a packed column shard: rank r holds its slice of each half."""
    model = FusedSwiGLU().eval()
    p = partitioner.partition(model, {"tp": 2}, ((), x_in()), rank=rank)
    assert p.linear_styles == {"proj": f"colwise packed [{F_DIM}, {F_DIM}]", "down": "rowwise"}
    assert p.slice_specs["proj.weight"] == p.slice_specs["proj.bias"] == {"tp": PackedShard(0, (F_DIM, F_DIM))}
    value, gate = model.proj.weight.detach().chunk(2, 0)
    expected = torch.cat([value.chunk(2, 0)[rank], gate.chunk(2, 0)[rank]])
    torch.testing.assert_close(p.state["proj.weight"], expected)
    torch.testing.assert_close(p.state["down.weight"], model.down.weight.detach().chunk(2, 1)[rank])


def test_plan_llama_gate_up_down():
    """Separate gate/up feeding silu(gate) * up -> down: both column-wise, down row-wise."""
    assert part(LlamaMLP()).linear_styles == {"gate": "colwise", "up": "colwise", "down": "rowwise"}


def test_plan_norm_over_features_stops_column_sharding():
    """A LayerNorm over the hidden features keeps up replicated, and explain names the norm."""
    p = part(NormMLP())
    assert p.linear_styles["up"] == "replicate"
    assert "up.weight" not in p.slice_specs
    assert "layer_norm" in p.explain("up") and "normalises" in p.explain("up")


def test_plan_few_rows_many_features_goes_rowwise():
    """A Linear on [2, 256] left outside any region is row-wise with its replicated input sliced locally."""
    p = part(AdaTable(normed=True), t_in())
    assert p.linear_styles == {"linear": "rowwise"}
    assert p.slice_specs == {"linear.weight": {"tp": Shard(1)}}
    (linear,) = nodes(p.graph_module, aten.linear.default)
    assert linear.args[0].target is aten.slice.Tensor and linear.args[0].args[0].name == "t"


def test_plan_graph_output_stops_column_sharding():
    """A column shard reaching the graph output is dropped (module docstring), so the table goes row-wise."""
    p = part(AdaTable(), t_in())
    assert not nodes(p.graph_module, collectives.all_gather_start)
    assert p.linear_styles == {"linear": "rowwise"}


def test_plan_overrides_take_precedence():
    """_tp_plan-style overrides win over the planner's own choice."""
    p = part(Stack(), plan={"blocks.*.up": "replicate"})
    assert p.linear_styles["blocks.0.up"] == p.linear_styles["blocks.1.up"] == "replicate"
    assert not any(name.startswith("blocks.0.up") or name.startswith("blocks.1.up") for name in p.slice_specs)
    p = part(Stack(), plan={"blocks.1.up": "rowwise"})
    assert p.linear_styles["blocks.1.up"] == "rowwise" and p.linear_styles["blocks.0.up"] == "colwise"
    assert p.slice_specs["blocks.1.up.weight"] == {"tp": Shard(1)}


@pytest.mark.parametrize("plan, match", [({"blocks.*.nothing": "colwise"}, "matches no Linear"),
                                         ({"blocks.0.up": "diagonal"}, "unknown style")])
def test_plan_bad_overrides_raise(plan, match):
    """A plan key matching no Linear, or an unknown style, is a PartitionError."""
    with pytest.raises(PartitionError, match=match):
        part(Stack(), plan=plan)


# --- 3. insert_collectives ---------------------------------------------------------------------------------------

def test_one_all_reduce_per_rowwise_linear():
    """Each row-wise linear's Partial output is reduced exactly once: all_reduce then wait_tensor."""
    p = part(Block())
    gm = p.graph_module
    reduces = nodes(gm, c10d.all_reduce.default)
    rowwise = [path for path, style in p.linear_styles.items() if style == "rowwise"]
    assert sorted(rowwise) == ["attn.to_out", "mlp.down"] and len(reduces) == len(rowwise)
    assert len(nodes(gm, c10d.wait_tensor.default)) == len(reduces)
    for reduce in reduces:
        assert reduce.args[0].target is aten.linear.default and reduce.args[1] == "sum"
        assert [u.target for u in reduce.users] == [c10d.wait_tensor.default]
    assert not nodes(gm, collectives.all_gather_start)


def test_rowwise_bias_added_once_after_reduction():
    """A row-wise linear loses its bias, which is added once to the reduced value."""
    gm = part(MLP()).graph_module
    down = next(n for n in nodes(gm, aten.linear.default) if n.args[1].name == "p_down_weight")
    assert len(down.args) == 2 or down.args[2] is None
    bias = next(n for n in gm.graph.nodes if n.name == "p_down_bias")
    (add,) = bias.users
    assert add.target is aten.add.Tensor and add.args[0].target is c10d.wait_tensor.default
    assert add.args[0].args[0].target is c10d.all_reduce.default and add.args[0].args[0].args[0] is down


def test_forced_colwise_is_gathered_before_norm():
    """A forced column-wise linear whose output meets a norm over its features is all_gathered before it."""
    p = part(NormMLP(), plan={"up": "colwise"})
    assert p.linear_styles["up"].startswith("colwise") and p.slice_specs["up.weight"] == {"tp": Shard(0)}
    gm = p.graph_module
    up = next(n for n in nodes(gm, aten.linear.default) if n.args[1].name == "p_up_weight")
    (norm,) = nodes(gm, aten.layer_norm.default)
    assert any(up in ancestors(g) and g in ancestors(norm) for g in nodes(gm, collectives.all_gather_start))
    assert annotation(norm.args[0]).placements["tp"] == Replicate()


@pytest.mark.parametrize("rank", [0, 1])
def test_replicated_input_consumed_as_shard_is_sliced_locally(rank):
    """A replicated value a row-wise linear needs sharded is sliced on the rank, with no collective."""
    gm = part(AdaTable(normed=True), t_in(), rank=rank).graph_module
    (piece,) = nodes(gm, aten.slice.Tensor)
    assert piece.args[0].name == "t" and tuple(piece.args[1:]) == (1, 128 * rank, 128 * (rank + 1))
    assert annotation(piece).collective is None and not nodes(gm, collectives.all_gather_start)
    assert len(nodes(gm, c10d.all_reduce.default)) == 1


def test_degree_one_is_the_identity():
    """At {"tp": 1} there are no collectives and the graph has the export's ops; it computes the model."""
    model, kwargs = Block().eval(), x_in()
    exported = trace(model, ((), kwargs)).graph_module
    p = partitioner.partition(model, {"tp": 1}, ((), kwargs))
    ops = [n.target for n in p.graph_module.graph.nodes if n.op == "call_function"]
    assert ops == [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert not any(getattr(t, "namespace", "") == "_c10d_functional" for t in ops)
    assert p.slice_specs == {} and set(p.linear_styles.values()) == {"replicate"}
    (out,) = run_graph(p.graph_module, p.ctx.inputs, p.state, [kwargs["x"]])
    torch.testing.assert_close(out, model(**kwargs))


# --- 4. localize -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_localize_parameter_shapes_and_slice_specs(rank):
    """Parameters have per-rank shapes in meta["val"], global ones in their annotation's global_shape, and a slice
    spec."""
    p = part(Block(), rank=rank)
    fqns = {node: gi.target for node, gi in p.ctx.placeholder_inputs(p.graph_module).items() if gi.kind != "user"}
    model_shapes = {name: tuple(t.shape) for name, t in Block().state_dict().items()}
    for node, fqn in fqns.items():
        placement = annotation(node).placements["tp"]
        assert annotation(node).global_shape == model_shapes[fqn]
        local = list(model_shapes[fqn])
        if is_sharded(placement):
            assert p.slice_specs[fqn] == {"tp": placement}
            local[placement.dim] //= 2
        else:
            assert fqn not in p.slice_specs
        assert tuple(node.meta["val"].shape) == tuple(local) == tuple(p.state[fqn].shape), fqn
    assert tuple(next(n for n, f in fqns.items() if f == "attn.to_q.weight").meta["val"].shape) == (D // 2, D)


def test_localize_explicit_view_sizes_are_local():
    """Views naming sizes inside a sharded region name this rank's sizes (half the heads, same head_dim)."""
    gm = part(Block(old_style=True)).graph_module
    sized = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)
             and is_sharded(annotation(n).placements["tp"])]
    splits = [n for n in sized if annotation(n).global_shape == (2, 6, HEADS, D // HEADS)]
    assert len(splits) == 3
    for node in sized:
        local = tuple(node.meta["val"].shape)
        assert math.prod(local) * 2 == math.prod(annotation(node).global_shape)
        assert [s for s in node.args[1] if s != -1] == [s for s, a in zip(local, node.args[1]) if a != -1]
    assert all(tuple(n.meta["val"].shape) == (2, 6, HEADS // 2, D // HEADS) for n in splits)


# --- 5. properties -----------------------------------------------------------------------------------------------

@st.composite
def equal_numel_shapes(draw):
    in_shape = draw(st.lists(st.integers(1, 6), max_size=5))
    rest, out_shape = math.prod(in_shape), []
    while rest > 1 or (len(out_shape) < 5 and draw(st.booleans())):
        size = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        out_shape.append(size)
        rest //= size
        if len(out_shape) == 5 and rest > 1:
            out_shape.append(rest)
            break
    return in_shape, out_shape


@settings(max_examples=100, deadline=None)
@given(equal_numel_shapes())
def test_view_groups_pair_equal_products_in_order(shapes):
    """_view_groups covers each input and output dim once, in order, pairing runs with equal products."""
    in_shape, out_shape = shapes
    groups = _view_groups(in_shape, out_shape)
    assert [d for gi, _ in groups for d in gi] == list(range(len(in_shape)))
    assert [d for _, gj in groups for d in gj] == list(range(len(out_shape)))
    for gi, gj in groups:
        assert math.prod(in_shape[d] for d in gi) == math.prod(out_shape[d] for d in gj)


@settings(max_examples=100, deadline=None)
@given(num=st.integers(1, 4), data=st.data())
def test_slice_local_matches_chunk_per_block(num, data):
    """slice_local / shard_slices give chunk(num)[index] of every packed block, concatenated."""
    blocks = tuple(num * b for b in data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)))
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, ndim - 1))
    index = data.draw(st.integers(0, num - 1))
    shape = [2] * ndim
    shape[dim] = sum(blocks)
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    placement = PackedShard(dim, blocks) if len(blocks) > 1 else Shard(dim)
    expected = torch.cat([block.chunk(num, dim)[index] for block in tensor.split(list(blocks), dim)], dim)
    assert torch.equal(slice_local(tensor, placement, num, index), expected)
    ranges = shard_slices(placement, sum(blocks), num, index)
    assert torch.equal(torch.cat([tensor.narrow(dim, a, b - a) for a, b in ranges], dim), expected)
    if len(blocks) == 1:
        assert torch.equal(slice_local(tensor, PackedShard(dim, blocks), num, index), expected)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.lists(st.integers(1, 4), min_size=1, max_size=4),
       st.integers(2, 3), st.booleans(), st.data())
def test_view_placement_against_brute_force(a, b, degree, units, data):
    """Whenever a view carries a sharded dim (even, uneven, or in whole units) to an output placement, every
    rank's elements are exactly its slices of the output: checked element by element on an arange. A request for
    coarser units (NeedsUnit) is honoured by the next try."""
    from partitioner.placement import packed_shard, unit_of
    from partitioner.rules import NeedsUnit, Unshardable, view_placement

    in_shape, out_shape = a + [math.prod(b)], b + [math.prod(a)]
    dim = data.draw(st.integers(0, len(in_shape) - 1))
    unit = data.draw(st.sampled_from([u for u in range(1, in_shape[dim] + 1) if in_shape[dim] % u == 0]))
    if in_shape[dim] // unit < degree:
        return
    placement = packed_shard(dim, (in_shape[dim],), unit, degree)
    try:
        out = view_placement(placement, in_shape, out_shape, degree, units=units)
    except NeedsUnit as request:  # coarser than the placement's unit (an even split normalises its unit to 1)
        assert units and request.unit % unit_of(placement) == 0 and request.unit > unit_of(placement)
        if in_shape[dim] % request.unit or in_shape[dim] // request.unit < degree:
            return
        placement = packed_shard(dim, (in_shape[dim],), request.unit, degree)
        out = view_placement(placement, in_shape, out_shape, degree, units=units)
    except Unshardable:
        return
    if not units and isinstance(placement, Shard):  # sequence axes never make units (they may carry one)
        assert isinstance(out, Shard)
    values = torch.arange(math.prod(in_shape)).reshape(in_shape)
    viewed = values.reshape(out_shape)
    for rank in range(degree):
        held = slice_local(values, placement, degree, rank)
        assert torch.equal(held.reshape(-1).sort().values,
                           slice_local(viewed, out, degree, rank).reshape(-1).sort().values)
