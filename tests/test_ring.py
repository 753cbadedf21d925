"""Ring attention over a "ring" mesh axis, alone and composed as (tp, ring, ulysses), on real gloo ranks against the
single-device model; full-size H3 at tp=8 x ring=2 x ulysses=8 on the fake process group; bad input.

Sizes are awkward on purpose: H3's packed sequence has 25 rows (13 + 12 over a ring of 2, 9 + 8 + 8 over 3), Flux's
joint sequence 24 (16 image and 8 text rows). Nothing is padded: each ring step sends exactly the rows its block has.

Tolerance: a rank attends its query rows over every key/value block and merges the partial results by their
log-sum-exp, so softmax sums in another order (measured ~2e-7 on O(1) outputs, float32); composed with TP the
row-parallel sums reorder too (as in test_tp_numerics). rtol = atol = 1e-5, as there. The negative control (the
blocks never passed on: each rank attends only its own keys) misses by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import partitioner
from partitioner import MeshError, PartitionError
from partitioner.runtime import collectives
from partitioner.testing import TINY_H3, fake_mesh, flux_inputs, full_h3_on_meta, h3_inputs, run_ranks, tiny_flux, tiny_h3

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
aten = torch.ops.aten


def _h3():
    return tiny_h3(), h3_inputs(TINY_H3, video=13, audio=7)  # 5 text + 13 video + 7 audio = 25 packed rows


def _first(out):
    return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)


def _run(shape, names, model, inputs, *, drop_passing: bool = False, plan=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    with torch.no_grad():
        expected = _first(model(**inputs))
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs),
                                        plan=plan)
    rings = [n for n in partitioned.graph_module.graph.nodes if n.target is collectives.ring_attention]
    if drop_passing:  # negative control: a ring of one, each rank attends only the keys it holds
        for node in rings:
            q, k, v, scale, rows, index, group = node.args
            node.args = (q, k, v, scale, [rows[index]], 0, group)
        partitioned.graph_module.recompile()
    return dict(expected=expected, actual=_first(partitioned.compile()(**inputs)), rings=len(rings),
                rows=[n.args[4] for n in rings], explain=partitioned.explain(),
                passes=partitioned.collective_counts()[("ring_pass", "ring")])


def _cases(rank: int, world: int, layouts: dict) -> dict:
    results = {}
    for name, (shape, names) in layouts.items():
        results[name] = _run(shape, names, *_h3())
        if world in (2, 3) or name == "ring2_u2":
            results[f"{name} flux"] = _run(shape, names, tiny_flux(), flux_inputs())
        if world == 2:
            results[f"{name} dropped"] = _run(shape, names, *_h3(), drop_passing=True)
    if world == 4:  # two axes splitting one dim the other way round: tp slices heads, then Ulysses exchanges them
        results["tp2_u2 k replicated flux"] = _run((2, 2), ("tp", "ulysses"), tiny_flux(), flux_inputs(),
                                                   plan={"transformer_blocks.*.attn.to_k": "replicate"})
    return results


@pytest.mark.parametrize("world, layouts", [
    (2, {"ring2": ((2,), ("ring",))}),
    (3, {"ring3": ((3,), ("ring",))}),
    (4, {"ring2_u2": ((2, 2), ("ring", "ulysses")), "tp2_ring2": ((2, 2), ("tp", "ring"))}),
    (8, {"tp2_ring2_u2": ((2, 2, 2), ("tp", "ring", "ulysses"))}),
], ids=["ring2", "ring3", "ring2xu2_tp2xring2", "tp2xring2xu2"])
def test_ring_every_rank_exact(world, layouts):
    """Every layout exact on every rank: both H3 main-block attentions and the text refiner's run as ring attention
    (the refiner's on the text rows, gathered once after it, before they are packed), each passing its block
    ring - 1 times; Flux's joint sequence (a packed
    shard of text and image rows) needs no reordering, since keys are summed over in any order (at ring x ulysses
    the packing is the ring's; Ulysses shards the joint rows of each ring shard). Also at TP=2 x Ulysses=2, a key
    projection kept whole: its heads are sliced over tp before Ulysses exchanges them."""
    results = run_ranks(world, _cases, layouts)
    for rank, result in enumerate(results):
        for name, case in result.items():
            if name.endswith("dropped"):
                assert (case["actual"] - case["expected"]).abs().max() > 1e-3, (name, rank)
                continue
            torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE, msg=f"{name} rank {rank}")
            if "flux" not in name:
                ring = dict(zip(*reversed(layouts[name])))["ring"]
                assert case["rings"] == 3 and case["passes"] == 3 * (ring - 1), (name, case["rings"])
                assert "transformer_blocks.0.attn: " in case["explain"] and "ring attention" in case["explain"]
    if world == 3:  # 25 rows over 3: 9 + 8 + 8, the blocks sized exactly (5 text rows: 2 + 2 + 1)
        assert results[0]["ring3"]["rows"] == [[2, 2, 1], [9, 8, 8], [9, 8, 8]]  # the refiner's 5 text rows first


def test_full_h3_tp8_ring2_ulysses8_structure():
    """Full-size H3 on 128 fake ranks, (tp, ring, ulysses) = (8, 2, 8), rank 0: ring groups pair ranks 8 apart,
    Ulysses groups contiguous runs of 8; each of the 50 main attentions runs on 1 head (56 / 8 / 8, rounded up)
    over 18944 query rows (37888 over the ring) and passes one block of 18944 key/value rows; 4 all_to_all each. The
    two text refiner attentions do the same over the 512 text rows."""
    model, inputs = full_h3_on_meta()
    with fake_mesh((8, 2, 8), ("tp", "ring", "ulysses"), 0) as mesh:
        partitioned = partitioner.partition(model, mesh, ((), inputs))
        assert mesh.get_group("ring").size() == 2 and partitioned.mesh.groups("ring")[0] == [0, 8]
        assert partitioned.mesh.groups("ulysses")[0] == list(range(8))
    rings = [n for n in partitioned.graph_module.graph.nodes if n.target is collectives.ring_attention]
    main = [n for n in rings if "transformer_blocks" in list(n.meta["nn_module_stack"].values())[-1][0]]
    assert len(main) == 50 and len(rings) == 52  # and the two refiner attentions, on 512 text rows
    for node in main:
        assert node.args[4] == [18944, 18944]
        assert tuple(node.args[0].meta["val"].shape) == (1, 1, 18944, 128)
    assert {tuple(n.args[4]) for n in rings} - {(18944, 18944)} == {(256, 256)}
    counts = partitioned.collective_counts()
    assert counts[("ring_pass", "ring")] == 52 and counts[("all_to_all", "ulysses")] == 4 * 52
    # the packed sequence is built locally: no value at the hidden width holds more than this rank's rows
    widest = max(n.meta["val"].shape[1] for n in partitioned.graph_module.graph.nodes
                 if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3
                 and n.meta["val"].shape[-1] == 5376)
    assert widest == 37888 // 16


def test_ring_bad_input():
    """A ring longer than every sequence, a mesh that puts ulysses outside ring (strided all-to-all groups), ring
    on Neuron: named errors with the fix (ring on XLA: tests/xla)."""
    model, inputs = _h3()
    with pytest.raises(PartitionError, match=r"a ring of 32 shards no attention.*smaller ring degree"):
        partitioner.partition(model, {"ring": 32}, ((), inputs))
    with pytest.raises(MeshError, match="innermost"):
        partitioner.partition(model, {"ulysses": 2, "ring": 2}, ((), inputs))
    with pytest.raises(partitioner.BackendError, match="ring attention is not lowered for Neuron"):
        partitioner.partition(model, {"ring": 2}, ((), inputs), backend_checks="neuron")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_block_fallback_matches_fused(dtype, monkeypatch):
    """The score-based block attention used where no fused kernel returns the log-sum-exp (off CPU), run here on
    CPU in query chunks smaller than the rows (so that the chunks are stitched): the same output and log-sum-exp as
    the fused CPU kernel, in float32 (rtol = atol = 1e-5, as the ring tests)."""
    monkeypatch.setattr(collectives, "QUERY_CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, rows, 16, generator=g).to(dtype) for rows in (20, 13, 13))
    fused = collectives._attention_block(q, k, v, 0.3, fused=True)
    chunked = collectives._attention_block(q, k, v, 0.3, fused=False)
    for a, b in zip(fused, chunked):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, **TOLERANCE)


def test_a_joint_sequence_whose_text_is_not_whole_frames_keeps_its_ring_attentions_sharded():
    """The video rows are regrouped into frames after the last attention (unpatchify): a ring axis asks every rank
    for whole frames there (3 frames of 8 rows: 1.5 a rank). The joint sequence (video + 18 text rows) is not whole frames: its seeds must not be
    dropped for it (every attention ran whole before), the rows are gathered after the attentions instead.
    (HunyuanVideo 1.5 at 480p over ring=2: 1 of 56 attentions sharded before, 56 now.)"""
    from partitioner.frontend.trace import trace
    from partitioner.mesh import as_mesh_spec
    from partitioner.build import decide
    from partitioner.passes.plan_sequence import attention_counts
    from partitioner.testing.zoo import build, inputs

    from partitioner.testing.zoo_check import partition_case

    sizes = dict(text=7, frames=3, height=2, width=4)
    traced = trace(build("hunyuan_video15"), inputs("hunyuan_video15", **sizes))
    ctx = decide(traced, as_mesh_spec({"ring": 2}, programs="rank"), "HunyuanVideo15")[0]
    assert attention_counts(ctx) == (3, 3), ctx.sequence_attention
    for rank, result in enumerate(run_ranks(2, partition_case, "hunyuan_video15", (2,), ("ring",), sizes)):
        assert result["status"] == "exact" and result["attention_sharded"] == 3, (rank, result)
        assert result["collectives"].get("ring_pass:ring"), result  # (exact because it ran as ring attention)


def test_ring_attention_fake_results_are_memoized_as_computed(monkeypatch):
    """localize propagates a ring attention once per distinct call (its loop over the ring's blocks runs on fake
    tensors); a later call with the same arguments' metadata (the next block, the planner's next cut) takes the
    remembered result's shape, stride and dtype: the rank graph is the same as with every call computed."""
    from partitioner.passes import regions

    targets = regions._memoized_targets

    def rank_graph(memo: bool, fresh: bool = True):
        if fresh:
            monkeypatch.setattr(regions, "_METADATA_RESULTS", {})
        monkeypatch.setattr(regions, "_memoized_targets", targets if memo else lambda: ())
        with fake_mesh((4,), ("ring",), 1) as mesh:
            graph = partitioner.partition(tiny_h3(num_layers=3), mesh, ((), h3_inputs(TINY_H3))).graph_module.graph
        return [(n.name, str(n.target), tuple(v.shape), v.stride(), v.dtype) for n in graph.nodes
                for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)], dict(regions._METADATA_RESULTS)

    computed, _ = rank_graph(memo=False)
    memoized, remembered = rank_graph(memo=True)
    again, _ = rank_graph(memo=True, fresh=False)  # every ring attention now from the memo
    assert memoized == computed and again == computed
    assert remembered and all(key[0] is collectives.ring_attention for key in remembered)


class WholeValues(torch.nn.Module):
    """Keys projected from the sequence-sharded rows, values from a running sum along the sequence (it needs every
    row, so they are computed whole): Ernie-Image's layout, keys S(2) and values R at the ring attention."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        def heads(y):
            return y.unflatten(-1, (2, -1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x.cumsum(1))))
        return self.o(out.transpose(1, 2).flatten(2))


def _whole_values(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return _run((world,), ("ring",), WholeValues().eval(), dict(x=torch.randn(1, 9, 16)))


def test_keys_sharded_and_values_whole_meet_in_the_ring_with_the_values_cut_alike():
    """Was: the attention left whole ("keys and values laid out alike (S(2) and R)"); the whole values are cut to
    this rank's rows (no communication) and travel the ring with the keys. Exact on every rank."""
    for rank, case in enumerate(run_ranks(2, _whole_values)):
        assert case["rings"] == 1, case["explain"]
        torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE, msg=f"rank {rank}")


class GroupedQuery(torch.nn.Module):
    """Grouped-query attention (4 query heads over 2 key/value heads, ``enable_gqa``), as AceStep and Cosmos 3
    write it; the key/value blocks travel the ring with their 2 heads and are widened per block."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).unflatten(-1, (4, -1)).transpose(1, 2)
        k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        return self.o(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2))


def _grouped_query(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cases = {}
    for drop in (False, True):
        cases[drop] = _run((world,), ("ring",), GroupedQuery().eval(), dict(x=torch.randn(1, 9, 16)),
                           drop_passing=drop)
    return cases


def test_grouped_query_attention_runs_as_ring_attention():
    """Was: left whole ("ring attention with fewer key/value heads than query heads"). Exact on every rank; the
    negative control (each rank attends only the key block it holds) is not."""
    for rank, cases in enumerate(run_ranks(2, _grouped_query)):
        assert cases[False]["rings"] == 1 and cases[False]["passes"] == 1, cases[False]["explain"]
        torch.testing.assert_close(cases[False]["actual"], cases[False]["expected"], **TOLERANCE, msg=f"rank {rank}")
        assert (cases[True]["actual"] - cases[True]["expected"]).abs().max() > 1e-3
