"""Neuron's rules, checked on CPU: each with a layout that passes and one that fails, messages included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partitioner
from partitioner.backends import neuron
from partitioner.backends.neuron import NeuronLegalityError
from partitioner.testing import full_h3_on_meta, h3_inputs


def full_h3(rows: int):
    model, _ = full_h3_on_meta()
    inputs = h3_inputs(dict(model.config), text=512, video=rows - 1024, audio=512, device="meta")
    return model, inputs


def test_full_size_h3_at_64_ranks_is_legal():
    """TP=8 x Ulysses=8 on 37888 = 74 x 512 rows passes every rule."""
    model, inputs = full_h3(37888)
    partitioned = partitioner.partition(model, {"tp": 8, "ulysses": 8}, ((), inputs), rank=63,
                                        backend_checks="neuron")
    assert neuron.check(partitioned.graph_module, partitioned.mesh) == []


def test_sequence_length_diagnostic_on_full_size_h3():
    """37900 rows: the nearest valid lengths and how many rows to trim or add, named per attention."""
    model, inputs = full_h3(37900)
    with pytest.raises(NeuronLegalityError) as error:
        partitioner.partition(model, {"tp": 8, "ulysses": 4}, ((), inputs), rank=0, backend_checks="neuron")
    message = str(error.value)
    assert ("transformer_blocks.0.attn: query packed length 37900 is not a multiple of 512; nearest valid: "
            "37888 (trim 12 rows) or 38400 (add 500 rows)") in message
    assert "token_refiner.refiner_blocks.0.attn: query packed length 512" not in message  # 512 text rows: fine
    assert neuron.sequence_length_advice(300) == \
        "packed length 300 is not a multiple of 512; nearest valid: 512 (add 212 rows)"


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
    (dict(head_dim=160), "head_dim 160 > 128"),
    (dict(mask=True), "an attention mask (bias) disables the flash kernel"),
    (dict(dtype=torch.float64), "float64 is not supported on Neuron"),
])
def test_attention_and_dtype_rules(case, words):
    """Each rule fails its case with the fix named; the same model without it passes."""
    dtype = case.get("dtype", torch.float32)
    with pytest.raises(NeuronLegalityError, match=words.replace("(", r"\(").replace(")", r"\)")):
        partitioner.partition(Attention(**case).eval(), {"tp": 2}, ((), {"x": torch.randn(1, 512, 128, dtype=dtype)}),
                              backend_checks="neuron")
    partitioner.partition(Attention().eval(), {"tp": 2}, ((), {"x": torch.randn(1, 512, 128)}),
                          backend_checks="neuron")


def test_dropout_rule():
    problems = neuron._attention_problems(_sdpa_node(dropout=0.1), None)
    assert problems == ["sdpa: dropout 0.1 disables the flash kernel; run in eval mode"]


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


def test_legal_graph_without_torch_neuronx_says_so():
    """Legalisation runs first; then the missing torch-neuronx is named, not a deep ImportError."""
    partitioned = partitioner.partition(Attention().eval(), {"tp": 2}, ((), {"x": torch.randn(1, 512, 128)}))
    with pytest.raises(RuntimeError, match="passed every Neuron check, but torch-neuronx is not installed"):
        neuron.lower(partitioned.graph_module, mesh=partitioned.mesh)
