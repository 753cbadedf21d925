"""The catalog of every model a pipeline carries (``partitioner.testing.catalog``, ``planning.coverage``): classes
listed from the installed diffusers, not typed in; a layout's shortfalls read from the plan as kinds of a closed
set. The table itself is ``benchmarks/models.py`` (docs/models.md)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import flex_attention

from partitioner.planning.coverage import Shortfall, coverage
from partitioner.testing.catalog import catalog, transformer_classes


def test_every_transformer_class_of_the_installed_diffusers_gets_a_row_even_one_added_at_run_time():
    import diffusers

    module = types.ModuleType("diffusers.models.transformers.transformer_added_here")

    class AddedTransformer2DModel(diffusers.ModelMixin):
        pass
    AddedTransformer2DModel.__module__ = module.__name__
    module.AddedTransformer2DModel = AddedTransformer2DModel
    sys.modules[module.__name__] = module
    try:
        classes = transformer_classes()
        entries = catalog()
    finally:
        del sys.modules[module.__name__]
    assert {"FluxTransformer2DModel", "MiniMaxH3Transformer3DModel", "AddedTransformer2DModel"} <= set(classes)
    assert len(classes) >= 70
    assert entries["AddedTransformer2DModel"].build is None  # a row that says it has no input builder
    assert entries["T5EncoderModel"].kind == "text encoder"


class _FlexBlock(nn.Module):
    """Grouped-query attention as flex_attention: counted, left whole under both layouts (flex_attention is split
    by heads only without groups, and not along rows)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 64), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, kv = self.qkv(x).split([32, 32], -1)
        q, (k, v) = q.view(b, n, 4, 8).transpose(1, 2), kv.view(b, n, 2, 2, 8).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, score_mod=lambda score, b, h, i, j: score + h, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, n, 32))


def test_a_layout_short_of_full_says_why_as_kinds():
    model, example = _FlexBlock().eval(), ((torch.randn(1, 6, 32),), {})
    sequence = coverage(model, {"ulysses": 2}, example)
    assert sequence.status == "partial" and Shortfall.ATTENTION_WHOLE in sequence.shortfalls, sequence
    assert sequence.attentions_sharded == (0, 1)
    tensor = coverage(model, {"tp": 2}, example)
    assert tensor.tp_share == 0.0 and Shortfall.LINEARS_WHOLE in tensor.shortfalls, tensor
    assert tensor.whole_linears == ("qkv", "out")  # largest first

    class Untraceable(nn.Module):
        def forward(self, x):
            return x.numpy()
    refused = coverage(Untraceable(), {"tp": 2}, example)
    assert refused.status == "refused" and refused.shortfalls == (Shortfall.TRACE_REFUSED,), refused
    assert "TraceError" in refused.error


# One model per class of failure the survey found, at the layout that failed (docs/models.md): each was refused or
# ended in an InvariantError on the ranks, and is exact on every rank now.
FORMER_FAILURES = [
    ("StableAudio3DiTModel", "ulysses"),  # a packed joint sequence re-split outside an attention (gathered instead)
    ("QwenImage21Transformer2DModel", "tp"),  # repeat_interleave sized by values the trace knew (localize failed)
    ("WanAnimateTransformer3DModel", "tp"),  # heads split from zero face rows (an ambiguous -1 over 0 elements)
    ("LuminaNextDiT2DModel", "tp"),  # a parameter left torch.empty (ranks built different weights)
]


@pytest.fixture(scope="module")
def two_ranks():
    from partitioner.testing import RankPool

    with RankPool(2) as pool:
        yield pool


@pytest.mark.parametrize("name, axis", FORMER_FAILURES)
def test_a_model_of_each_former_failure_class_is_exact_on_every_rank(two_ranks, name, axis):
    from partitioner.testing.catalog import partition_case

    results = two_ranks.run(partition_case, name, (2,), (axis,), dict(text=7) if axis == "ulysses" else None)
    assert [r["status"] for r in results] == ["exact", "exact"], results
