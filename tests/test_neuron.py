"""Neuron's rules, checked on CPU: each with a layout that passes and one that fails, messages included."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import partitioner
from partitioner.backends import neuron
from partitioner.backends.neuron import NeuronLegalityError
from partitioner.passes import narrow_indices
from partitioner.runtime.program import InputError
from partitioner.testing import TINY_H3, full_h3_on_meta, h3_inputs, run_ranks, tiny_h3
from partitioner.annotations import annotation


def full_h3(rows: int, text: int = 512):
    model, _ = full_h3_on_meta()
    inputs = h3_inputs(dict(model.config), text=text, video=rows - text - 512, audio=512, device="meta")
    return model, inputs


@pytest.fixture
def every_attention_large(monkeypatch):
    """Tiny models' attentions judged as if their scores were too large for the chip and recorded to stall: the
    flash kernel's own rules (length, head_dim, mask, dropout) then decide."""
    monkeypatch.setattr(neuron, "SBUF_BYTES", 0)
    monkeypatch.setattr(neuron, "STALL_BYTES", 0)


def test_full_size_h3_at_64_ranks_is_legal():
    """TP=8 x Ulysses=8 on 37888 = 74 x 512 rows passes every rule."""
    model, inputs = full_h3(37888)
    partitioned = partitioner.partition(model, {"tp": 8, "ulysses": 8}, ((), inputs), rank=63,
                                        backend_checks="neuron")
    assert neuron.check(partitioned.graph_module, partitioned.mesh) == []


def test_768p_layout_that_ran_passes_and_one_that_stalled_is_refused():
    """The 768p layout that ran on Trainium2 (TP=8 x Ulysses=4, 37888 packed rows, 178 text rows) passes with
    no error and no warning: the text refiner's 178-row attention is not a multiple of 512, but its scores (7 heads
    x 178 x 178 float32, 0.85 MiB) stay on chip. 37726 rows is refused with the nearest valid lengths, in one line
    for the 50 blocks (the 7 heads of a tp rank are padded to 8 for Ulysses: 2 per rank)."""
    model, inputs = full_h3(37888, text=178)
    with warnings.catch_warnings():
        warnings.simplefilter("error", neuron.NeuronPerformanceWarning)
        partitioner.partition(model, {"tp": 8, "ulysses": 4}, ((), inputs), rank=0, backend_checks="neuron")
    model, inputs = full_h3(37726, text=178)
    with pytest.raises(NeuronLegalityError) as error:
        partitioner.partition(model, {"tp": 8, "ulysses": 4}, ((), inputs), rank=0, backend_checks="neuron")
    problems = str(error.value).splitlines()[1:]
    assert len(problems) == 1, problems
    assert problems[0].startswith("  query packed length 37726 is not a multiple of 512; nearest valid: 37376 (trim "
                                  "350 rows) or 37888 (add 162 rows)")
    assert "(1 x 2 x 37726 x 37726 = 10.6 GiB) exceed a NeuronCore's 28.0 MiB SBUF" in problems[0]
    assert "compile was recorded never to finish" in problems[0]
    assert problems[0].endswith("[in transformer_blocks.{0-49}.attn (50)]")
    assert neuron.sequence_length_advice(300) == \
        "packed length 300 is not a multiple of 512; nearest valid: 512 (add 212 rows)"


def test_ulysses_2_on_full_size_h3_is_one_problem():
    """TP=8 x Ulysses=2 on 37888 rows: the all-to-all group size is the only problem, said once."""
    model, inputs = full_h3(37888)
    with pytest.raises(NeuronLegalityError) as error:
        partitioner.partition(model, {"tp": 8, "ulysses": 2}, ((), inputs), rank=0, backend_checks="neuron")
    assert str(error.value).splitlines()[1:] == [
        "  all-to-all over 2 ranks: Neuron accepts groups of 4, 8, 16 or a multiple of 32; use a ulysses degree of "
        "[4, 8, 16]"]


@pytest.mark.parametrize("rows, warned", [(1915, False), (1916, True)])
def test_attention_just_under_and_over_the_on_chip_threshold(rows, warned):
    """2 heads of 1915 rows: 2 x 1915 x 1915 float32 = 27.98 MiB of scores fit a NeuronCore's 28 MiB SBUF, so the
    length (not a multiple of 512) does not matter; 1916 rows (28.01 MiB) are tiled through HBM: legal, with a
    warning naming the length fix. Neither is refused: far below the recorded stall."""
    inputs = ((), {"x": torch.randn(1, rows, 128)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        partitioner.partition(Attention(), {"tp": 1}, inputs, backend_checks="neuron")
    found = [w for w in caught if issubclass(w.category, neuron.NeuronPerformanceWarning)]
    assert len(found) == warned
    if warned:
        assert f"query packed length {rows} is not a multiple of 512" in str(found[0].message)
        assert "exceed a NeuronCore's 28.0 MiB SBUF and are tiled through HBM" in str(found[0].message)


def test_problems_are_grouped_by_module_index():
    found = [neuron.Finding(True, "too long", f"blocks.{i}.attn") for i in (0, 1, 2, 5, 1)] + \
        [neuron.Finding(True, "too long", "refiner.attn"), neuron.Finding(True, "float64", "mul_3")]
    assert neuron.grouped(found) == ["too long [in blocks.{0-2,5}.attn (4), refiner.attn]", "float64 [in mul_3]"]


def test_batch_axis_passes_neuron_checks():
    """A batch of 2 split over dp beside tp, and over cfg beside ulysses=4: the batch split adds nothing Neuron
    refuses (the output's all_gather is a collective it has). (Flux itself is refused on Neuron, batch or not: its
    rotary tables are computed in float64 and copied to the CPU inside the graph.)"""
    class PerRow(Attention):  # the attention's output itself, so that the batch has something to gather
        def forward(self, x):
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    x = torch.randn(2, 512, 128)
    for layout in ({"dp": 2, "tp": 2}, {"cfg": 2, "ulysses": 4}):
        partitioned = partitioner.partition(PerRow(heads=4).eval(), layout, ((), {"x": x}), rank=1,
                                            backend_checks="neuron")
        assert partitioned.collective_counts()[("all_gather", next(iter(layout)))] == 1
        assert neuron.check(partitioned.graph_module, partitioned.mesh) == []


def test_all_to_all_group_sizes():
    """Ulysses=2 is refused with the degrees Neuron accepts; 4, 8, 16 and multiples of 32 pass."""
    assert [n for n in range(1, 65) if neuron.valid_all_to_all_size(n)] == [1, 4, 8, 16, 32, 64]
    model = Attention(head_dim=32, heads=4)
    with pytest.raises(NeuronLegalityError, match=r"all-to-all over 2 ranks: .*4, 8, 16 or a multiple of 32; "
                                                  r"use a ulysses degree of \[4\]"):
        partitioner.partition(model, {"ulysses": 2}, ((), {"x": torch.randn(1, 512, 128)}), backend_checks="neuron")
    partitioner.partition(model, {"ulysses": 4}, ((), {"x": torch.randn(1, 512, 128)}), backend_checks="neuron")


class Attention(nn.Module):
    def __init__(self, head_dim=64, heads=2, mask=False, dropout=0.0, dtype=torch.float32):
        super().__init__()
        self.heads, self.mask, self.dropout = heads, mask, dropout
        self.qkv = nn.Linear(128, 3 * heads * head_dim, dtype=dtype)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device) if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout).sum()


@pytest.mark.parametrize("case, words", [
    (dict(head_dim=160), "head_dim 160 > 128 keeps the NKI flash kernel from this attention"),
    (dict(mask=True), "an attention mask (bias) keeps the NKI flash kernel from this attention"),
    (dict(dtype=torch.float64), "float64 is not supported on Neuron"),
])
def test_attention_and_dtype_rules(case, words, monkeypatch):
    """Each rule fails its case with the fix named (attentions judged large); the same model without it passes,
    and so does the case itself where its scores are small enough to stay on chip (float64 always fails)."""
    dtype = case.get("dtype", torch.float32)
    inputs = ((), {"x": torch.randn(1, 512, 128, dtype=dtype)})
    if "dtype" not in case:
        partitioner.partition(Attention(**case).eval(), {"tp": 2}, inputs, backend_checks="neuron")
    monkeypatch.setattr(neuron, "SBUF_BYTES", 0)
    monkeypatch.setattr(neuron, "STALL_BYTES", 0)
    with pytest.raises(NeuronLegalityError, match=words.replace("(", r"\(").replace(")", r"\)")):
        partitioner.partition(Attention(**case).eval(), {"tp": 2}, inputs, backend_checks="neuron")
    partitioner.partition(Attention().eval(), {"tp": 2}, ((), {"x": torch.randn(1, 512, 128)}),
                          backend_checks="neuron")


def test_dropout_rule(every_attention_large):
    found = neuron._attention_findings(_sdpa_node(dropout=0.1), None)
    assert [(f.where, f.problem.split(";")[0]) for f in found] == [
        ("sdpa", "dropout 0.1 (run in eval mode) keeps the NKI flash kernel from this attention")]


def _sdpa_node(dropout: float):
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    q.meta["val"] = torch.empty(1, 2, 512, 64, device="meta")
    node = graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, q, q, None, dropout))
    node.name = "sdpa"
    return node


class ToCpu(nn.Module):
    def forward(self, x):
        return (x * 2).to("cpu", dtype=torch.float16).float() + 1


def test_copies_to_the_cpu_are_refused():
    inputs = {"x": torch.randn(4, 4, device="meta")}
    with pytest.raises(NeuronLegalityError, match="copies a tensor \\[4, 4\\] to the CPU inside the device graph"):
        partitioner.partition(ToCpu(), {"tp": 1}, ((), inputs), backend_checks="neuron")


def test_legal_graph_without_torch_neuronx_says_so(every_attention_large):
    """Legalisation runs first; then the missing torch-neuronx is named, not a deep ImportError. 300 rows pass
    once padded."""
    partitioned = partitioner.partition(Attention().eval(), {"tp": 2}, ((), {"x": torch.randn(1, 512, 128)}))
    with pytest.raises(RuntimeError, match="passed every Neuron check, but torch-neuronx is not installed"):
        neuron.lower(partitioned.graph_module, mesh=partitioned.mesh)
    partitioned = partitioner.partition(Attention().eval(), {"tp": 2}, ((), {"x": torch.randn(1, 300, 128)}))
    with pytest.raises(NeuronLegalityError, match="packed length 300 is not a multiple of 512"):
        neuron.lower(partitioned.graph_module, mesh=partitioned.mesh)
    with pytest.raises(RuntimeError, match="passed every Neuron check, but torch-neuronx is not installed"):
        neuron.lower(partitioned.graph_module, mesh=partitioned.mesh, pad_sequence=True)


# --- legalisation: int64 indices narrowed to int32, attention padded exactly to multiples of 512 ---

class Lookup(nn.Module):
    def forward(self, table, rows, picks, tags):
        positions = torch.arange(4)  # only an index: int32
        shifted = table.index_select(0, tags * 2**20 % 5)  # arithmetic: tags stays int64
        return table[positions] + table.index_select(0, rows[:4]) + table.gather(0, picks) + shifted[:4]


def _lookup_inputs(rows=(4, 0, 2, 1, 3)):
    table = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    return table, torch.tensor(rows), torch.tensor([[1], [0], [4], [2]]).expand(4, 3), torch.tensor([0, 1, 3, 2])


def test_index_narrowing_rules():
    """Inputs and aranges used only as indices become int32 (through slices); values from arithmetic and gather
    indices stay int64; the narrowed graph gives identical results, and an input outside int32 is named."""
    gm = partitioner.partition(Lookup(), {"tp": 1}, (_lookup_inputs(), {})).graph_module
    legal = neuron.legalize(gm)
    dtypes = {n.name: n.meta["val"].dtype for n in legal.graph.nodes if n.op == "placeholder" or "arange" in n.name}
    assert dtypes == dict(table=torch.float32, rows=torch.int32, picks=torch.int64, tags=torch.int64,
                          arange=torch.int32)
    assert [n.meta["val"].dtype for n in gm.graph.nodes if n.name == "rows"] == [torch.int64]  # gm untouched
    run = narrow_indices.cast_inputs(legal, legal)
    assert torch.equal(run(*_lookup_inputs())[0], gm(*_lookup_inputs())[0])
    with pytest.raises(InputError, match=r"rows holds values in \[0, 2147483648\], outside int32"):
        run(*_lookup_inputs(rows=(4, 0, 2, 1, 2**31)))


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo mesh, and torch-neuronx stood in for by torch.compile running the legalised graph as is."""
    import diffusers  # noqa: F401 (before the stand-in: diffusers probes for torch_neuronx when imported)
    from torch.distributed.device_mesh import init_device_mesh

    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setattr(torch, "compile", lambda gm, backend: gm)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def test_narrowed_tiny_h3_is_exact(one_rank):
    """H3's video, audio and text indices (index_select, and the index_copy building the packed sequence, which
    becomes index_put) run as int32: bit-identical outputs. timestep_indices * 3 + token_tags stays int64."""
    model = tiny_h3()
    inputs = h3_inputs(TINY_H3, text=512, video=500, audio=12)  # 1024 rows: legal without padding
    partitioned = partitioner.partition(model, one_rank, ((), inputs))
    expected = partitioned.compile()(**inputs, return_dict=False)
    actual = partitioned.compile(backend="neuron")(**inputs, return_dict=False)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    legal = neuron.legalize(partitioned.graph_module)
    assert [n.name for n in legal.graph.nodes if annotation(n).narrowed_from is not None] == \
        ["video_indices", "audio_indices", "text_indices"]
    bad = dict(inputs, audio_indices=inputs["audio_indices"] + 2**32)
    with pytest.raises(InputError, match=r"index out of range: 4294967\d+ .* from audio_indices indexes index_copy"):
        partitioned.compile(backend="neuron")(**bad)  # the preflight, before Neuron's own casts
    # index_copy refuses a negative index; its index_put stand-in would wrap it, so Neuron's cast refuses it too
    negative = dict(inputs, text_indices=inputs["text_indices"] - inputs["text_indices"].max() - 1)
    with pytest.raises(InputError, match=r"index out of range: -\d+ .* from text_indices .*valid indices are in \[0"):
        partitioned.compile()(**negative)
    unchecked = partitioned.compile(backend="neuron")
    unchecked.preflight.program = None  # Neuron's input casts are a second line of defence
    with pytest.raises(InputError, match=r"audio_indices holds values in \[\d+, \d+\], outside int32"):
        unchecked(**bad)
    with pytest.raises(InputError, match=r"text_indices holds a negative index .*index_copy"):
        unchecked(**negative)


def _drop_normalisation(gm, backend):
    """A negative control standing in for the device compiler: o1 / o2 replaced by o1."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.div.Tensor and "padded_attention" in node.meta:
            node.replace_all_uses_with(node.args[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _padded_h3(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)  # 23 packed rows, 5 text rows
    sys.modules["torch_neuronx"] = types.ModuleType("torch_neuronx")  # after diffusers' import probes for it
    neuron.SBUF_BYTES = neuron.STALL_BYTES = 0  # judge the tiny attentions as large ones (a process of its own)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)),
                                        ((), inputs))
    legal = neuron.legalize(partitioned.graph_module, pad_sequence=True)
    results = dict(expected=partitioned.compile()(**inputs, return_dict=False),
                   problems=(neuron.check(partitioned.graph_module, partitioned.mesh),
                             neuron.check(legal, partitioned.mesh)))
    for name, compiler in (("padded", lambda gm, backend: gm), ("dropped", _drop_normalisation)):
        torch.compile = compiler
        results[name] = partitioned.compile(backend="neuron", pad_sequence=True)(**inputs, return_dict=False)
    return results


def test_padded_attention_is_exact_on_tiny_h3():
    """Ulysses=4 on gloo (the all-to-all size Neuron takes): every attention padded to 512 rows (23 packed, 5 text)
    matches the unpadded graph, and the padded graph has no sequence-length problem left.

    Tolerance 1e-5 absolute on outputs of magnitude ~1: o1 and o2 are softmax averages over the same padded keys,
    each within a few float32 ulps, and their ratio adds one rounding; measured 2.4e-7. Negative control: without
    the division by o2 the padded keys' share of the softmax (489 of 512 rows) stays: measured 4e-2."""
    for result in run_ranks(4, _padded_h3):
        for actual, expected in zip(result["padded"], result["expected"]):
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        assert (result["dropped"][0] - result["expected"][0]).abs().max() > 1e-2
        before, after = result["problems"]
        assert before and all("not a multiple of 512" in p for p in before)
        assert after == []


class SdpaWith(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.options)


def test_padding_copies_a_key_so_very_negative_scores_stay_exact():
    """Every score -400 (10 x -10 x 16 channels / sqrt(16)): padding with zero keys (score 0) would leave
    exp(-400) = 0 in o1 and o2 and a NaN ratio; copies of a real key share the real maximum and keep o2 >= 1/(1+P).
    Queries and keys of different lengths (7 and 300). Measured error 4e-8."""
    q, k, v = torch.full((1, 2, 7, 16), 10.0), torch.full((1, 2, 300, 16), -10.0), torch.randn(1, 2, 300, 16)
    gm = partitioner.partition(SdpaWith(), {"tp": 1}, ((q, k, v), {})).graph_module
    legal = neuron.legalize(gm, pad_sequence=True)
    torch.testing.assert_close(legal(q, k, v)[0], gm(q, k, v)[0], rtol=0, atol=1e-5)
    pad = lambda x: F.pad(x, (0, 0, 0, 512 - x.shape[-2]))  # noqa: E731
    zero_keys = F.scaled_dot_product_attention(pad(q), pad(k), pad(v)) / \
        F.scaled_dot_product_attention(pad(q), pad(k), pad(torch.ones_like(v)))
    assert zero_keys[..., :7, :].isnan().all()


PADDING_CASES = {  # (q, k, v shapes, sdpa options); every error measured at or below 1.1e-6
    "gqa": (((1, 4, 300, 16), (1, 2, 300, 16), (1, 2, 300, 16)), dict(enable_gqa=True)),
    "scale": (((1, 2, 300, 16), (1, 2, 300, 16), (1, 2, 300, 16)), dict(scale=0.9)),
    "batch3_q600_k513": (((3, 2, 600, 16), (3, 2, 513, 16), (3, 2, 513, 16)), {}),
    "v_head_dim_24": (((1, 2, 70, 16), (1, 2, 70, 16), (1, 2, 70, 24)), {}),
    "causal": (((1, 2, 70, 16), (1, 2, 70, 16), (1, 2, 70, 16)), dict(is_causal=True)),
}


@pytest.mark.parametrize("case", sorted(PADDING_CASES))
def test_padding_is_exact_for_every_attention_form(case, every_attention_large):
    """The padded graph against the unpadded one, with the options passed through (GQA, scale, causal), batch > 1,
    unequal query and key lengths, a value head_dim of its own. float32: a few ulps (1e-5 on unit-scale outputs)."""
    shapes, options = PADDING_CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in shapes)
    gm = partitioner.partition(SdpaWith(**options), {"tp": 1}, ((q, k, v), {})).graph_module
    legal = neuron.legalize(gm, pad_sequence=True)
    attentions = [n for n in legal.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert all(n.args[0].meta["val"].shape[-2] % 512 == 0 and n.args[1].meta["val"].shape[-2] % 512 == 0
               for n in attentions)
    assert len(attentions) == (1 if options.get("is_causal") else 2)  # causal: later keys are masked anyway
    assert neuron.check(legal, partitioner.mesh.as_mesh_spec({"tp": 1})) == []
    torch.testing.assert_close(legal(q, k, v)[0], gm(q, k, v)[0], rtol=1e-5, atol=1e-5)


def test_unpaddable_attention_is_not_offered_padding(every_attention_large):
    """A causal attention of unequal lengths cannot be padded at the end exactly: the check says so, without
    suggesting pad_sequence."""
    q, k, v = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16)
    gm = partitioner.partition(SdpaWith(is_causal=True), {"tp": 1}, ((q, k, v), {})).graph_module
    problems = neuron.check(neuron.legalize(gm, pad_sequence=True), partitioner.mesh.as_mesh_spec({"tp": 1}))
    assert problems and not any("pad_sequence" in p for p in problems)


@pytest.mark.parametrize("checks", [{}, {"neuron": True}, {"neuron": {"bogus": 1}}, {"xla": {}}, "inductor"])
def test_backend_checks_option_is_validated(checks):
    q = torch.randn(1, 2, 512, 16)
    with pytest.raises(ValueError, match="backend_checks="):
        partitioner.partition(SdpaWith(), {"tp": 1}, ((q, q, q), {}), backend_checks=checks)


def test_offline_checks_with_padding_and_dump(tmp_path, every_attention_large):
    """backend_checks={"neuron": {"pad_sequence": True}} passes where plain checks fail on the length, and the
    legalised graph is dumped after the passes as 17_neuron_legalize, diffed against 16_schedule_collectives."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with pytest.raises(NeuronLegalityError, match="packed length 23 is not a multiple of 512"):
        partitioner.partition(model, {"tp": 2}, ((), inputs), backend_checks="neuron")
    partitioner.partition(model, {"tp": 2}, ((), inputs), backend_checks={"neuron": {"pad_sequence": True}},
                          dump_dir=tmp_path)
    tmp_path = tmp_path / "rank0"
    code, diff = (tmp_path / "17_neuron_legalize.py").read_text(), (tmp_path / "17_neuron_legalize.diff").read_text()
    assert "aten.constant_pad_nd" in code and "aten.index_put" in code and 'video_indices: "i32[12]"' in code
    assert "+++ 17_neuron_legalize" in diff and (tmp_path / "16_schedule_collectives.py").exists()


def test_full_size_h3_padded_checks():
    """37900 rows: padded to 38400 per attention, the full-size graph passes every rule."""
    model, inputs = full_h3(37900)
    partitioner.partition(model, {"tp": 8, "ulysses": 4}, ((), inputs), rank=0,
                          backend_checks={"neuron": {"pad_sequence": True}})


def test_uneven_tp16_x_ulysses4_is_legal():
    """A 64-core Trainium2 host as tp=16 x ulysses=4: 56 heads split 4/3 over tp, then over ulysses inside each tp
    group. The last rank (tp rank 15: 3 heads; ulysses rank 3: none) passes every rule."""
    model, inputs = full_h3(37888)
    partitioned = partitioner.partition(model, {"tp": 16, "ulysses": 4}, ((), inputs), rank=63,
                                        backend_checks="neuron")
    assert neuron.check(partitioned.graph_module, partitioned.mesh) == []
    heads = {n.meta["val"].shape[1] for n in partitioned.graph_module.graph.nodes
             if n.target is torch.ops.aten.scaled_dot_product_attention.default}
    assert heads == {0}  # every attention (the refiner's too) sequence-sharded: none of the tp rank's 3 heads left
