"""Decisions are data: what the passes decide travels as typed values (``partitioner/decisions.py``), and their text
is only for people. Each decision type's ``__str__`` replaced by random text leaves every rank program, every
collective and every plan fingerprint of the zoo as it was."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import partitioner
from partitioner import Plan
from partitioner.decisions import DECISIONS, LinearSharding, Style
from partitioner.testing.zoo import build, inputs

# a DiT of each structure: joint MMDiT (packed blocks), in-place rotary (Wan), video with refiners, linear attention
CASES = [("flux", {"tp": 2, "ulysses": 2}), ("wan", {"tp": 3}), ("qwen_image", {"ring": 2, "tp": 2}),
         ("sana", {"dp": 2, "tp": 2}), ("hunyuan_video", {"ulysses": 2})]


def _programs() -> dict:
    programs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", partitioner.PartitionWarning)
        for name, mesh in CASES:
            model, example = build(name), inputs(name)
            if "dp" in mesh:  # two images
                example = ((), {key: torch.cat([value, value]) if isinstance(value, torch.Tensor) else value
                                for key, value in example[1].items()})
            partitioned = partitioner.partition(model, mesh, example, rank=1)
            programs[name] = (partitioned.graph_module.code, partitioned.collective_counts(),
                              Plan.of(partitioned).fingerprint, partitioned.slice_specs)
    return programs


def test_rewording_every_decision_changes_no_rank_program(monkeypatch):
    before = _programs()
    noise = random.Random(0)
    for kind in DECISIONS:
        monkeypatch.setattr(kind, "__str__", lambda self: f"reworded {noise.random()}")
    assert str(LinearSharding(Style.COLWISE)).startswith("reworded")
    after = _programs()
    for case, program in before.items():
        assert after[case] == program, case


def test_a_warning_names_the_attention_left_whole_once():
    """The rule's refusal starts with the attention's module; the warning adds the axis, not the module again."""
    from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

    with pytest.warns(partitioner.PartitionWarning) as caught:
        partitioner.partition(tiny_h3(), {"ulysses": 4}, ((), h3_inputs(TINY_H3, text=3)))
    text = " ".join(str(w.message) for w in caught)
    assert "token_refiner.refiner_blocks.0.attn: ulysses: a sequence of 3 rows" in text, text
