"""The XLA SPMD backend on 4 virtual CPU devices: numerics against the single-device model, and XLA's partitioned
HLO holding exactly the plan's collectives (kind, count and replica groups)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import partitioner
from partitioner.backends.xla import CollectiveMismatch, XlaBackendError, axis_of
from partitioner.placement import PackedShard, Shard
from partitioner.testing import (TINY_H3, H3DenoiseStep, denoise_inputs, flux_cfg_inputs, flux_inputs, h3_inputs,
                                 idiom_cases, tiny_flux, tiny_h3)
from partitioner.annotations import annotation

# float32 sums over sharded dims are reordered (per-shard partial sums, then the all-reduce), and attention runs as
# einsums instead of SDPA's kernel: a few ulps on O(1) outputs; same bound as the gloo tests.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
MESHES = {"tp4": {"tp": 4}, "ulysses4": {"ulysses": 4}, "tp2_ulysses2": {"tp": 2, "ulysses": 2}}


def _h3():
    return tiny_h3(), h3_inputs(TINY_H3)


def _flux():
    return tiny_flux(), flux_inputs()


def _h3_six_heads():
    return tiny_h3(num_attention_heads=6), h3_inputs(TINY_H3)


# Flux: a packed cat([attention, mlp]) of unequal blocks, layer norms. H3 with 6 heads: at TP=2 x Ulysses=2 each tp
# rank's 3 heads split 2 + 1 over ulysses, which XLA's equal tiles express only once padded (see xla.Nested).
MODELS = {"h3": _h3, "flux": _flux, "h3_six_heads": _h3_six_heads}


def _outputs(result):
    return (result.sample,) if hasattr(result, "sample") else result


@pytest.fixture(scope="module")
def model_and_reference():
    model, inputs = _h3()
    with torch.no_grad():
        return model, inputs, model(**inputs, return_dict=False)


CASES = [(name, layout) for name in sorted(MODELS) for layout in sorted(MESHES)
         if (name, layout) != ("h3_six_heads", "tp4")]  # 6 heads over TP=4 split 2, 2, 1, 1: see the uneven test


@pytest.mark.parametrize("name, layout", CASES)
def test_numerics_and_collectives_match_the_plan(name, layout):
    model, inputs = MODELS[name]()
    with torch.no_grad():
        expected = _outputs(model(**inputs))
    partitioned = partitioner.partition(model, MESHES[layout], ((), inputs), programs="global")
    compiled = partitioned.compile(backend="xla")  # verify=True: raises CollectiveMismatch on any difference
    actual = _outputs(compiled(**inputs))
    for a, e in zip(actual, expected, strict=True):
        assert a.device.type == "cpu" and not a.requires_grad
        torch.testing.assert_close(a, e, **TOLERANCE)
    found = compiled.stats.collectives
    mesh = partitioned.mesh
    # The built-in check, restated: every collective XLA inserted runs over one of the mesh axis's groups, and
    # the counts per (kind, axis) are the plan's.
    assert Counter((c.kind, axis_of(c.groups, mesh)) for c in found) == partitioned.collective_counts()
    assert found and compiled.stats.mismatches == []
    kinds = {c.kind for c in found}
    if "tp" in MESHES[layout]:
        assert "all_reduce" in kinds
    if "ulysses" in MESHES[layout]:
        assert "all_to_all" in kinds


def test_uneven_heads_exact_and_refused_by_verify():
    """6 heads and an FFN of 98 over TP=4 (2, 2, 1, 1 heads; [98, 98] SwiGLU halves of 25, 25, 24, 24 rows):
    verify=True refuses by name (XLA's equal tiles add data movement the plan does not have), verify=False runs
    it, exact on every output."""
    config = dict(num_attention_heads=6, hidden_size=96, time_embed_hidden_dim=96, ffn_dim=98)
    model, inputs = tiny_h3(**config), h3_inputs({**TINY_H3, **config})
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    partitioned = partitioner.partition(model, {"tp": 4}, ((), inputs), programs="global")
    assert partitioned.linear_styles["transformer_blocks.0.attn.to_q"] == "colwise uneven 16-32 in units of 16"
    with pytest.raises(XlaBackendError, match="unevenly in whole units"):
        partitioned.compile(backend="xla")
    actual = partitioned.compile(backend="xla", verify=False)(**inputs, return_dict=False)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)


@pytest.mark.parametrize("layout", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(idiom_cases()))
def test_model_idioms(name, layout):
    """Fused projections cut with split, joint attention, zeros_like, view-split heads, masks: exact, and exactly
    the plan's collectives."""
    factory, inputs = idiom_cases()[name]
    torch.manual_seed(0)
    model = factory().eval()
    with torch.no_grad():
        expected = model(**inputs)
    compiled = partitioner.partition(model, MESHES[layout], ((), inputs), programs="global").compile(backend="xla")
    torch.testing.assert_close(compiled(**inputs), expected, **TOLERANCE)
    assert compiled.stats.mismatches == []


def test_mixed_precision_h3_as_the_checkpoint_is():
    """bf16 weights with the float32 modules H3 keeps: the plan's collectives, and outputs no further from the CPU
    bf16 model than bf16 itself is from float32 (bf16 rounding differs with the summation order; measured 3e-3
    against 1.4e-2)."""
    from partitioner.planning.planner import apply_dtype

    model, reference = apply_dtype(tiny_h3(), torch.bfloat16), tiny_h3()
    inputs = h3_inputs(TINY_H3)
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        expected, exact = model(**low, return_dict=False), reference(**inputs, return_dict=False)
    compiled = partitioner.partition(model, {"tp": 2, "ulysses": 2}, ((), low), programs="global").compile(backend="xla")
    for a, e, x in zip(compiled(**low, return_dict=False), expected, exact, strict=True):
        assert (a.float() - e.float()).abs().max() <= (e.float() - x).abs().max()


def test_naive_fused_swiglu_annotation_is_detected(model_and_reference):
    """Negative control: shard the fused [value; gate] weights as one plain column shard (what a hand-written
    annotation does). XLA then re-lays the halves out with collectives the plan does not have: the check names
    them."""
    model, inputs, expected = model_and_reference
    partitioned = partitioner.partition(model, {"tp": 2, "ulysses": 2}, ((), inputs), programs="global")
    naive = 0
    for node in partitioned.planned_graph.graph.nodes:
        placements = annotation(node).placements
        if any(isinstance(p, PackedShard) for p in placements.values()):
            annotation(node).placements = {a: Shard(p.dim) if isinstance(p, PackedShard) else p
                                       for a, p in placements.items()}
            naive += 1
    assert naive
    compiled = partitioned.compile(backend="xla")
    with pytest.raises(CollectiveMismatch, match="collective_permute over pairs: XLA has [1-9]"):
        compiled(**inputs, return_dict=False)
    with pytest.warns(UserWarning, match="collective_permute"):  # verify="warn" reports and returns the result
        actual = partitioned.compile(backend="xla", verify="warn")(**inputs, return_dict=False)
    torch.testing.assert_close(actual[0], expected[0], **TOLERANCE)  # XLA stays correct, only slower


def test_host_prologue_runs_on_cpu_device_graph_on_xla():
    """H3's denoising step: torch.unique runs in the CPU prologue, its padded results feed the XLA graph; one
    partition serves steps with 1 to 4 distinct timesteps."""
    step = H3DenoiseStep(tiny_h3())
    steps = {1: [0.5] * 4, 2: [0.9, 0.9, 0.1, 0.1], 4: [0.7, 0.5, 0.1, 0.2]}
    partitioned = partitioner.partition(step, {"tp": 2, "ulysses": 2}, ((), denoise_inputs(TINY_H3, steps[4])), programs="global")
    assert partitioned.ctx.host is not None
    compiled = partitioned.compile(backend="xla")
    for timesteps in steps.values():
        inputs = denoise_inputs(TINY_H3, timesteps)
        with torch.no_grad():
            expected = step(**inputs)
        for a, e in zip(compiled(**inputs), expected):
            torch.testing.assert_close(a, e, **TOLERANCE)


def test_a_smaller_mesh_runs_on_every_group_of_devices(model_and_reference):
    """TP=2 on 4 devices: the plan on devices (0, 1) and again on (2, 3); its all-reduces over [[0, 1], [2, 3]]."""
    model, inputs, expected = model_and_reference
    partitioned = partitioner.partition(model, {"tp": 2}, ((), inputs), programs="global")
    compiled = partitioned.compile(backend="xla")
    for a, e in zip(compiled(**inputs, return_dict=False), expected, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)
    assert {c.groups for c in compiled.stats.collectives} == {((0, 1), (2, 3))}
    assert len(compiled.stats.collectives) == partitioned.report().count("all_reduce")


def test_mesh_size_must_divide_the_xla_devices(model_and_reference):
    model, inputs, _ = model_and_reference
    with pytest.raises(XlaBackendError, match="do not divide XLA's 4; on CPU start with .*CPU_NUM_DEVICES=3"):
        partitioner.partition(tiny_h3(num_attention_heads=3), {"tp": 3}, ((), inputs), programs="global").compile(backend="xla")


def test_counts_on_tiny_h3_are_those_the_readme_gives(model_and_reference):
    model, inputs, _ = model_and_reference
    expected = {"tp4": {("all_reduce", "tp"): 11},
                "ulysses4": {("all_to_all", "ulysses"): 8, ("all_gather", "ulysses"): 2},
                "tp2_ulysses2": {("all_reduce", "tp"): 11, ("all_to_all", "ulysses"): 8,
                                 ("all_gather", "ulysses"): 2}}
    for layout, counts in expected.items():
        partitioned = partitioner.partition(model, MESHES[layout], ((), inputs), programs="global")
        compiled = partitioned.compile(backend="xla")
        compiled(**inputs)
        found = compiled.stats.collectives
        assert Counter((c.kind, axis_of(c.groups, partitioned.mesh)) for c in found) == Counter(counts), layout
        groups = {axis: sorted(map(list, c.groups)) for c in found for axis in [axis_of(c.groups, partitioned.mesh)]}
        for axis, seen in groups.items():
            assert seen == sorted(partitioned.mesh.groups(axis))


class PackedThroughPointwise(torch.nn.Module):
    """A fused [value; gate] projection scaled and shifted before the split (as a bias, scale or cast would be)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(32, 16)

    def forward(self, x):
        value, gate = (self.up(x) * 1.5 + 0.25).to(torch.float32).chunk(2, -1)
        return self.down(value * torch.nn.functional.silu(gate))


def test_packed_values_pass_pointwise_ops_without_collectives():
    torch.manual_seed(0)
    model, x = PackedThroughPointwise().eval(), torch.randn(2, 5, 16)
    partitioned = partitioner.partition(model, {"tp": 4}, ((x,), {}), programs="global")
    assert partitioned.linear_styles == {"up": "colwise packed [32, 32]", "down": "rowwise"}
    compiled = partitioned.compile(backend="xla")  # would raise CollectiveMismatch on a re-layout
    torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    assert [c.kind for c in compiled.stats.collectives] == ["all_reduce"]


def test_meta_model_with_loaded_weights(tmp_path):
    """Full-size models are partitioned on meta weights: load_weights then reads whole tensors for XLA."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    with torch.device("meta"):
        meta_model = tiny_h3()
    meta_inputs = {name: value.to("meta") for name, value in inputs.items()}
    partitioned = partitioner.partition(meta_model, {"tp": 2, "ulysses": 2}, ((), meta_inputs), programs="global")
    with pytest.raises(RuntimeError, match="meta device"):
        partitioned.compile(backend="xla")
    compiled = partitioned.load_weights(tmp_path).compile(backend="xla")
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    for a, e in zip(compiled(**inputs, return_dict=False), expected, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)
    # load_weights after compile: the compiled program reads the new checkpoint's whole tensors
    other = tiny_h3(seed=1)
    other.save_pretrained(tmp_path / "other")
    partitioned.load_weights(tmp_path / "other")
    with torch.no_grad():
        expected = other(**inputs, return_dict=False)
    for a, e in zip(compiled(**inputs, return_dict=False), expected, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)


def test_verify_after_an_unverified_compile_of_the_same_graph_says_why():
    torch.manual_seed(1)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.GELU(), torch.nn.Linear(24, 8)).eval(), \
        torch.randn(3, 8)
    partitioned = partitioner.partition(model, {"tp": 4}, ((x,), {}), programs="global")
    partitioned.compile(backend="xla", verify=False)(x)
    with pytest.raises(XlaBackendError, match="reused this graph, compiled earlier in this process without verify"):
        partitioned.compile(backend="xla")(x)


def test_torch_compile_with_the_xla_backend():
    """torch.compile(model, backend="partitioner", options={"mesh": {...}, "backend": "xla"}): dynamo's graph,
    planned and handed to XLA SPMD, verified like any other."""
    factory, inputs = idiom_cases()["split_sizes"]
    torch.manual_seed(0)
    model = factory().eval()
    with torch.no_grad():
        expected = model(**inputs)
        compiled = torch.compile(model, backend="partitioner", options={"mesh": {"tp": 4}, "backend": "xla"})
        torch.testing.assert_close(compiled(**inputs), expected, **TOLERANCE)



def test_weights_move_to_the_devices_once():
    """Later calls reuse the sharded weights on the devices; a weight changed in place is moved again."""
    model, inputs = _h3()  # its own model: the weights are changed below
    compiled = partitioner.partition(model, {"tp": 2, "ulysses": 2}, ((), inputs), programs="global").compile(backend="xla")
    first = compiled(**inputs, return_dict=False)
    placed = {index: entry[1] for index, entry in compiled.lowered.placed.items()}
    compiled(**inputs, return_dict=False)
    weights = range(len(compiled.state))
    assert all(compiled.lowered.placed[i][1] is placed[i] for i in weights)
    with torch.no_grad():
        compiled.state[0].mul_(2)
    changed = compiled(**inputs, return_dict=False)
    assert compiled.lowered.placed[0][1] is not placed[0]
    assert not torch.equal(changed[0], first[0])


RING_MESHES = {"ring4": {"ring": 4}, "ring2_ulysses2": {"ring": 2, "ulysses": 2}, "tp2_ring2": {"tp": 2, "ring": 2}}


@pytest.mark.parametrize("layout", sorted(RING_MESHES))
def test_ring_attention_as_collective_permutes(layout):
    """Ring attention on XLA SPMD: the key/value blocks move one place per step along a block dim the ring shards,
    which XLA's partitioner lowers to one collective-permute between ring neighbours per step (ring - 1 per
    attention: the plan's ring passes; the output's gather over ring x ulysses is one all-gather over both axes'
    devices); exact against the single-device model (24 packed rows: equal blocks).
    Negative control: the same graph with the blocks not rolled (each rank attends only its own keys) is wrong."""
    from partitioner.backends.xla import ops, plan_key

    model, inputs = tiny_h3(), h3_inputs(TINY_H3, video=13, audio=6)  # 5 + 13 + 6 = 24 packed rows
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    partitioned = partitioner.partition(model, RING_MESHES[layout], ((), inputs), programs="global")
    compiled = partitioned.compile(backend="xla")  # verify=True: the HLO's collectives are the plan's
    for a, e in zip(compiled(**inputs, return_dict=False), expected, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)
    found = Counter(plan_key(c, partitioned.mesh) for c in compiled.stats.collectives)
    ring = RING_MESHES[layout]["ring"]
    assert found[("ring_pass", "ring")] == (ring - 1) * TINY_H3["num_layers"] == \
        partitioned.collective_counts()[("ring_pass", "ring")]

    original = ops._pass_on
    try:
        ops._pass_on = lambda blocks: blocks * 1  # never passed on
        unpassed = partitioner.partition(model, RING_MESHES[layout], ((), inputs), programs="global").compile(backend="xla",
                                                                                           verify=False)
        actual = unpassed(**inputs, return_dict=False)
    finally:
        ops._pass_on = original
    assert (actual[0] - expected[0]).abs().max() > 1e-3


def test_ring_on_xla_refuses_uneven_blocks_by_name():
    """25 packed rows over a ring of 2: XLA's equal tiles cannot hold 13 + 12 rows; the error says what to do."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3, video=13, audio=7)
    partitioned = partitioner.partition(model, {"ring": 2}, ((), inputs), programs="global")
    with pytest.raises(XlaBackendError, match="25 query and 25 key rows over a ring of 2"):
        partitioned.compile(backend="xla")(**inputs)


@pytest.mark.parametrize("layout", [{"dp": 2, "tp": 2}, {"cfg": 2, "ulysses": 2}], ids=["dp2_tp2", "cfg2_ulysses2"])
def test_batch_axis_on_xla(layout):
    """Flux with classifier-free guidance's halves as a batch of 2, the batch split over a dp (or cfg) axis beside tp
    or ulysses: exact, XLA's collectives equal to the plan's (verify=True), and over the batch axis nothing but the
    output's all-gather."""
    inputs, model = flux_cfg_inputs(), tiny_flux()
    with torch.no_grad():
        expected = model(**inputs).sample
    partitioned = partitioner.partition(model, layout, ((), inputs), programs="global")
    compiled = partitioned.compile(backend="xla")
    torch.testing.assert_close(compiled(**inputs).sample, expected, **TOLERANCE)
    batch = next(iter(layout))
    counts = Counter((c.kind, axis_of(c.groups, partitioned.mesh)) for c in compiled.stats.collectives)
    assert counts == partitioned.collective_counts() and compiled.stats.mismatches == []
    assert {kind for kind, axis in counts if axis == batch} == {"all_gather"} and counts[("all_gather", batch)] == 1
