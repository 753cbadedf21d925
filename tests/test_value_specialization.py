"""Value specialisation: a model that reads its mask's values in Python, written here with the two idioms the zoo
has (the rules are about ops, not about Lumina2 or Mochi):

- a Python branch on the mask's row sums (``len(set(lengths))``, as Lumina2 does): export cannot trace it;
- padded text rows dropped with ``nonzero`` before a joint attention and padded back after it (as Mochi does): a
  data-dependent size that sizes device ops, which the host prologue cannot take.

``partition`` traces such a model for the example's mask (``value_specialization``): exact on every rank in TP=2,
Ulysses=2 and TP=2 x Ulysses=2 against the unpartitioned model (1e-5, float32 with sums reordered, as
test_tp_numerics). Under Ulysses the joint attention's output is gathered for the padding, its rows put back from
rank order into the sequence's order. A call with another mask is refused by the traced program and served by the
drop-in module, traced again. Negative controls: without the reorder, or with the value guard bypassed, the answer
is wrong.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from partitioner import partition
from partitioner.errors import InputError, TraceError
from partitioner.testing import RankPool

TOLERANCE = 1e-5
MODES = {"tp2": ((2,), ("tp",)), "ulysses2": ((2,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses"))}
HEADS, HEAD_DIM, ROWS, TEXT = 4, 8, 8, 6


class MaskedJointBlock(torch.nn.Module):
    """Image rows and the text's valid rows in one joint attention; the text rows padded back after it."""

    def __init__(self):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.qkv, self.text_qkv = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, 3 * width)
        self.out, self.text_out = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor):
        lengths = mask.sum(dim=1).tolist()
        if len(set(lengths)) > 1:  # a Python branch on the mask's values
            raise ValueError("one text length per batch")
        keep = torch.nonzero(mask[0]).flatten()  # its size is the mask's row sum
        valid = text[:, keep]
        rows, kept = x.shape[1], valid.shape[1]
        heads = lambda t: t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)  # noqa: E731
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        tq, tk, tv = (heads(t) for t in self.text_qkv(valid).chunk(3, dim=-1))
        joint = F.scaled_dot_product_attention(torch.cat([q, tq], 2), torch.cat([k, tk], 2), torch.cat([v, tv], 2))
        joint = F.pad(joint, (0, 0, 0, text.shape[1] - kept))  # padded text rows back, as zeros
        image, text_rows = joint.split([rows, text.shape[1]], dim=2)
        merge = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731
        return self.out(merge(image)), self.text_out(merge(text_rows))


def _inputs(pad: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, TEXT, dtype=torch.int64)
    mask[:, TEXT - pad:] = 0
    return torch.randn(1, ROWS, HEADS * HEAD_DIM, generator=g), torch.randn(1, TEXT, HEADS * HEAD_DIM, generator=g), mask


def _error(got, expected) -> float:
    return max((g - e).abs().max().item() for g, e in zip(got, expected))


def _case(rank, world, mode, broken):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import insert_collectives

    torch.manual_seed(0)
    model = MaskedJointBlock().eval()
    x, text, mask = _inputs()
    shape, names = MODES[mode]
    in_sequence_order = mock.patch.object(
        insert_collectives, "_gather_in_packed_order",
        lambda attention, current, blocks, axis, ctx: insert_collectives._all_gather(attention, current, axis, ctx))
    with in_sequence_order if broken == "order" else contextlib.nullcontext():
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((x, text, mask), {}))
    module = partitioned.compile()
    with torch.no_grad():
        expected = model(x, text, mask)
    result = dict(error=_error(module(x, text, mask), expected),
                  values={i: v.tolist() for i, v in partitioned.traced.values.items()},
                  reads=[str(r) for r in partitioned.traced.value_reads],
                  collectives={f"{k}:{a}": n for (k, a), n in partitioned.collective_counts().items()},
                  sharded=[p for p, why in partitioned.ctx.sequence_attention.items() if why.startswith("sequence")])
    other = _inputs(pad=3, seed=1)  # another mask: the traced program refuses it, the module traces again
    with torch.no_grad():
        other_expected = model(*other)
    try:
        module.program(*other)
        result["program"] = "accepted"
    except InputError as error:
        result["program"] = str(error)
    if broken == "guard":  # the traced program run on a mask it was not traced for
        partitioned.traced.values.clear()
        result["other_error"] = _error(module.program(*other), other_expected)
    else:
        result["other_error"] = _error(module(*other), other_expected)
        result["specializations"] = list(module.specializations)
    return result


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


def _run(pools, mode, broken=None):
    shape = MODES[mode][0]
    return pools[2 if shape == (2,) else 4].run(_case, mode, broken)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_model_that_reads_its_mask_is_traced_for_the_mask_and_exact(pools, mode):
    results = _run(pools, mode)
    for rank, result in enumerate(results):
        assert result["error"] <= TOLERANCE, (rank, result)
        assert result["values"] == {2: [[1, 1, 1, 1, 0, 0]]}, result  # the mask, the third flat argument
        assert "has other values than the ones this partition was traced for" in result["program"], result
        assert result["other_error"] <= TOLERANCE, (rank, result)  # served by a trace for the other mask
        assert result["specializations"] == ["other values of mask"], result
    reads = "\n".join(results[0]["reads"])
    assert "Tensor.tolist of mask at test_value_specialization.py" in reads or "Tensor.item of mask" in reads, reads
    if "ulysses" in MODES[mode][1]:
        assert results[0]["sharded"], results[0]  # the joint attention runs sequence-sharded
        assert results[0]["collectives"].get("all_to_all:ulysses", 0) >= 3, results[0]
    if "tp" in MODES[mode][1]:
        assert results[0]["collectives"].get("all_reduce:tp", 0) >= 2, results[0]


@pytest.mark.parametrize("broken", ["order", "guard"])
def test_negative_control_without_the_reorder_or_the_value_guard_is_wrong(pools, broken):
    results = _run(pools, "ulysses2", broken)
    if broken == "order":  # the gathered rows left in rank order
        assert max(r["error"] for r in results) > 1e-3, results
    else:  # the program traced for one mask, run on another
        assert max(r["other_error"] for r in results) > 1e-3, results


def test_a_float_input_is_never_specialised():
    """A branch on a float input's values (latents, a timestep: they change at every step) stays a trace error
    that names the model's line; only integer and boolean inputs are specialised."""
    class BranchOnFloat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.proj(x) * (2.0 if t.item() > 0.5 else 1.0)

    with pytest.raises(TraceError, match=r"test_value_specialization.py:\d+ in forward"):
        partition(BranchOnFloat(), {"tp": 2}, ((torch.randn(2, 4), torch.tensor(0.7)), {}))
