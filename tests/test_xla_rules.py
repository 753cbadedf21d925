"""The XLA backend's parts that need no torch_xla: placements as partition specs, reading partitioned HLO, the
comparison with the plan, and its errors. (tests/xla runs the backend itself, in the torch_xla environment.)"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import partitioner
from partitioner.backends.xla import XlaBackendError, axis_of, compare, hlo_collectives, packed_spec, partition_spec
from partitioner.errors import MeshError
from partitioner.mesh import as_mesh_spec
from partitioner.placement import PackedShard, Partial, Replicate, Shard
from partitioner.testing import TINY_H3, fake_mesh, h3_inputs, tiny_h3
from partitioner.annotations import annotation

MESH = as_mesh_spec({"tp": 2, "ulysses": 2})
AXES = MESH.axis_names

HLO = """
ENTRY %main.1_spmd (param: f32[1,6,48]) -> f32[1,6,48] {
  %all-reduce.2 = f32[2,32]{1,0} all-reduce(%dot.12), channel_id=5, replica_groups={{0,2},{1,3}}, to_apply=%add
  %all-to-all = (f32[1,1,12,16]{3,2,1,0}, f32[1,1,12,16]{3,2,1,0}) all-to-all(%a, %b), replica_groups=[2,2]<=[4]
  %all-gather.1 = f32[1,24,48]{2,1,0} all-gather(%c), channel_id=7, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={1}
  %collective-permute.7 = f32[2,24]{1,0} collective-permute(%d), channel_id=27, source_target_pairs={{0,2},{1,3}}
  ROOT %all-reduce-start = f32[8]{0} all-reduce-start(%e), replica_groups={{0,1,2,3}}, to_apply=%add
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %all-gather.2 = f32[4,8]{1,0} all-gather(%f), channel_id=9, replica_groups={}, dimensions={0}
  %fusion = f32[8]{0} fusion(%all-reduce.2), kind=kLoop, calls=%fused
}
"""


def test_placements_become_partition_specs_in_mesh_order():
    assert partition_spec({"tp": Shard(2), "ulysses": Shard(1)}, 4, AXES) == (None, "ulysses", "tp", None)
    assert partition_spec({"tp": Shard(1), "ulysses": Shard(1)}, 4, AXES) == (None, ("tp", "ulysses"), None, None)
    assert partition_spec({"tp": Shard(-1), "ulysses": Replicate()}, 3, AXES) == (None, None, "tp")
    assert partition_spec({"tp": Partial(), "ulysses": Replicate()}, 2, AXES) is None  # XLA cannot say Partial
    # a packed value's dim is held rank-major as [ranks, rows]: tp shards the rank dim, later dims shift right
    assert packed_spec({"tp": PackedShard(0, (96, 96)), "ulysses": Replicate()}, 2, AXES) == ("tp", None, None)
    assert packed_spec({"tp": PackedShard(1, (64, 256)), "ulysses": Shard(2)}, 3, AXES) == (None, "tp", None,
                                                                                          "ulysses")


def test_hlo_collectives_are_read_with_their_groups():
    found = hlo_collectives(HLO)
    assert [(c.name, c.kind) for c in found] == [
        ("all-reduce.2", "all_reduce"), ("all-to-all", "all_to_all"), ("all-gather.1", "all_gather"),
        ("collective-permute.7", "collective_permute"), ("all-reduce-start", "all_reduce"),
        ("all-gather.2", "all_gather")]  # an async pair counts once
    assert found[0].groups == ((0, 2), (1, 3))
    assert found[1].groups == ((0, 1), (2, 3))  # iota form [2,2]<=[4]
    assert found[2].groups == ((0, 2), (1, 3))  # iota form, transposed
    assert found[3].groups == ((0, 2), (1, 3))  # source-target pairs
    assert found[1].shape.startswith("(f32[1,1,12,16]")
    assert [axis_of(c.groups, MESH) for c in (found[0], found[1], found[4], found[5])] == ["tp", "ulysses", "all",
                                                                                         "all"]  # {}: all devices
    assert axis_of(((0, 3), (1, 2)), MESH) == "groups [[0, 3], [1, 2]]"


def test_comparison_names_what_differs():
    found = hlo_collectives(HLO)
    planned = Counter({("all_reduce", "tp"): 1, ("all_to_all", "ulysses"): 1, ("all_gather", "ulysses"): 1,
                       ("all_reduce", "all"): 1, ("all_gather", "all"): 1})
    problems = compare(found, planned, MESH)
    # all-gather.1's groups are tp's groups written transposed: it is over tp, not ulysses
    assert problems == [
        "all_gather over tp: XLA has 1, the plan 0; XLA's: all-gather.1 f32[1,24,48]{2,1,0} [[0, 2], [1, 3]]",
        "all_gather over ulysses: XLA has 0, the plan 1",
        "collective_permute over pairs: XLA has 1, the plan 0; XLA's: collective-permute.7 f32[2,24]{1,0} "
        "[[0, 2], [1, 3]]"]
    exact = Counter({("all_reduce", "tp"): 1, ("all_to_all", "ulysses"): 1, ("all_gather", "tp"): 1,
                     ("collective_permute", "pairs"): 1, ("all_reduce", "all"): 1, ("all_gather", "all"): 1})
    assert compare(found, exact, MESH) == []


def test_xla_backend_needs_torch_xla(monkeypatch):
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    partitioned = partitioner.partition(model, {"tp": 2}, ((), inputs), programs="global")
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # as where torch_xla is not installed
    with pytest.raises(XlaBackendError, match=r"needs torch_xla.*torch==2\.9\.0"):
        partitioned.compile(backend="xla")


def test_xla_backend_needs_a_mesh_of_axis_sizes():
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with fake_mesh((2,), ("tp",), 0) as mesh:
        partitioned = partitioner.partition(model, mesh, ((), inputs))
    assert partitioned.global_state is None  # a rank keeps only its shards
    with pytest.raises(RuntimeError, match=r"one global program \(XLA SPMD\).*planned for rank programs.*"
                       r"partition\(model, \{'tp': 2\}, example_inputs, programs='global'\)"):
        partitioned.compile(backend="xla")


def test_axis_sizes_plan_what_a_mesh_of_those_sizes_runs_and_xla_is_asked_for_by_name():
    """Sizes plan the rank programs a DeviceMesh of the same sizes runs (a plan read from sizes is the one run);
    XLA's global program only by name, and a DeviceMesh cannot plan it."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    sized = partitioner.partition(model, {"tp": 2, "ulysses": 2}, ((), inputs))
    assert sized.mesh.per_rank
    with pytest.raises(RuntimeError, match=r"programs='global'"):
        sized.compile(backend="xla")
    with fake_mesh((2, 2), ("tp", "ulysses"), 0) as mesh:
        meshed = partitioner.plan(model, mesh, ((), inputs))
        with pytest.raises(MeshError, match="pass the axis sizes instead"):
            partitioner.plan(model, mesh, ((), inputs), programs="global")
    assert partitioner.plan(model, {"tp": 2, "ulysses": 2}, ((), inputs)).fingerprint == meshed.fingerprint
    assert not partitioner.partition(model, {"tp": 2}, ((), inputs), programs="global").mesh.per_rank
    with pytest.raises(MeshError, match=r"programs='spmd'.*\['rank', 'global'\]"):
        partitioner.plan(model, {"tp": 2}, ((), inputs), programs="spmd")


def test_planned_graph_is_the_global_plan_and_independent_of_the_rank_graph():
    """The plan is kept before insert_collectives: global shapes, placements on every value, no collective; and
    its requirements point at its own nodes."""
    partitioned = partitioner.partition(tiny_h3(), {"tp": 2, "ulysses": 2}, ((), h3_inputs(TINY_H3)), programs="global")
    planned = partitioned.planned_graph
    nodes = set(planned.graph.nodes)
    assert not nodes & set(partitioned.graph_module.graph.nodes)
    for node in planned.graph.nodes:
        assert annotation(node).collective is None
        assert set(annotation(node).placements) == {"tp", "ulysses"}
        for requirements in (annotation(node).required or {}).values():
            assert set(requirements) <= nodes
    weight = next(n for n in planned.graph.nodes if n.name == "p_transformer_blocks_0_ff_net_0_proj_weight")
    assert tuple(weight.meta["val"].shape) == (2 * TINY_H3["ffn_dim"], TINY_H3["hidden_size"])  # global shape


def test_packed_values_are_held_rank_major():
    """A packed value's rank-major layout is what each rank holds (its slice of every block, in block order), and
    the Linear rules on it compute what the fused Linear does."""
    from partitioner.backends.xla import Packed, _linear, _split_packed

    value, gate = torch.randn(3, 8), torch.randn(3, 4)  # unequal blocks, as Flux's cat([attention, mlp])
    packed = Packed.from_blocks((value, gate), dim=1, ranks=2)
    assert packed.tensor.shape == (3, 2, 6)
    for rank in range(2):
        expected = torch.cat([value[:, 4 * rank:4 * rank + 4], gate[:, 2 * rank:2 * rank + 2]], dim=1)
        torch.testing.assert_close(packed.tensor[:, rank], expected, rtol=0, atol=0)
    torch.testing.assert_close(packed.fused(), torch.cat([value, gate], 1), rtol=0, atol=0)
    pieces = _split_packed(torch.ops.aten.split_with_sizes.default, packed, (packed, [8, 4], 1), {})
    assert all(torch.equal(a, b) for a, b in zip(pieces, (value, gate), strict=True))
    assert _split_packed(torch.ops.aten.split_with_sizes.default, packed, (packed, [6, 6], 1), {}) is None

    x, weight, bias = torch.randn(5, 12), torch.randn(12, 12), torch.randn(12)  # SwiGLU: rows packed [6, 6]
    rows = Packed.from_blocks(weight.split([6, 6], 0), dim=0, ranks=2)
    rows_bias = Packed.from_blocks(bias.split([6, 6], 0), dim=0, ranks=2)
    out = _linear(x, rows, rows_bias)
    torch.testing.assert_close(out.fused(), torch.nn.functional.linear(x, weight, bias))
    halves = _split_packed(torch.ops.aten.chunk.default, out, (out, 2, -1), {})
    torch.testing.assert_close(torch.cat(halves, -1), torch.nn.functional.linear(x, weight, bias))

    down = torch.randn(7, 12)  # row-wise Linear reading a packed input: one contraction over (ranks, rows)
    columns = Packed.from_blocks(down.split([8, 4], 1), dim=1, ranks=2)
    torch.testing.assert_close(_linear(packed, columns), torch.nn.functional.linear(torch.cat([value, gate], 1), down))


def test_nested_uneven_shards_are_padded_to_equal_tiles():
    """6 heads over tp=2 then ulysses=2: each tp rank's 3 heads split 2 + 1. Padded to 4 per tp rank, XLA's equal
    tiles of 2 hold exactly the plan's heads: (tp0, u0) heads 0-1, (tp0, u1) head 2, (tp1, u0) 3-4, (tp1, u1) 5."""
    from partitioner.backends.xla import Nested, nested_uneven

    heads = {"tp": Shard(1), "ulysses": Shard(1)}
    assert nested_uneven(heads, (1, 6, 23, 16), MESH) == (1, 2, 2)
    assert nested_uneven(heads, (1, 8, 23, 16), MESH) is None  # 4 per tp rank: even
    assert nested_uneven({"tp": Shard(1), "ulysses": Shard(2)}, (1, 6, 23, 16), MESH) is None
    value = torch.arange(6.0).reshape(1, 6, 1, 1)
    padded = Nested.pad(value, 1, 2, 2)
    tiles = padded.tensor.flatten().split(2)
    assert [t.tolist() for t in tiles] == [[0, 1], [2, 0], [3, 4], [5, 0]]
    assert torch.equal(padded.unpad(), value)

