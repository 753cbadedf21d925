"""Value specialisation: a model that reads its mask's values in Python, written here with the two idioms the zoo
has (the rules are about ops, not about Lumina2 or Mochi):

- a Python branch on the mask's row sums (``len(set(lengths))``, as Lumina2 does): export cannot trace it;
- padded text rows dropped with ``nonzero`` before a joint attention and padded back after it (as Mochi does): a
  data-dependent size that sizes device ops, which the host prologue cannot take.

``partition`` traces such a model for the example's mask (``value_specialization``): exact on every rank in TP=2,
Ulysses=2 and TP=2 x Ulysses=2 against the unpartitioned model (1e-5, float32 with sums reordered, as
test_tp_numerics). Under Ulysses the padding is one more block of the packed joint rows (each rank pads its part),
and the outputs' packed rows are gathered rank by rank and put back in the sequence's order. A call with another mask is refused by the traced program and served by the
drop-in module, traced again. Negative controls: without the reorder, or with the value guard bypassed, the answer
is wrong.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from partitioner import partition
from partitioner.errors import InputError, PartitionError, TraceError
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
    rank_order_kept = mock.patch.object(insert_collectives, "_in_sequence_order", lambda gathered, *_: gathered)
    with rank_order_kept if broken == "order" else contextlib.nullcontext():
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((x, text, mask), {}))
    module = partitioned.compile()
    checked = partitioned.verify(x, text, mask).nodes_checked if broken is None else 0  # value by value
    with torch.no_grad():
        expected = model(x, text, mask)
    result = dict(error=_error(module(x, text, mask), expected), checked=checked,
                  values={i: v.tolist() for i, v in partitioned.traced.values.items()},
                  reads=[str(r) for r in partitioned.traced.value_reads],
                  collectives={f"{k}:{a}": n for (k, a), n in partitioned.collective_counts().items()},
                  sharded=[p for p, why in partitioned.ctx.sequence_attention.items() if why.sharded])
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


class _ReadsItsMaskForLongBatches(torch.nn.Module):
    """Reads the mask's values only for batches over 2: the first trace (batch 2) is not specialised, a later one is.
    Each trace also makes a constant of its own (a literal table)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        scale = int(mask.sum()) if x.shape[0] > 2 else 1
        return self.proj(x) * scale + torch.tensor([[3.0], [5.0], [7.0]])[: x.shape[0]]


def _retraced_for_values(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = _ReadsItsMaskForLongBatches().eval()
    mask = torch.tensor([[1, 1, 0]])
    module = partition(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                       ((torch.randn(2, 4), mask), {})).compile()
    errors = []
    for x, m in ((torch.randn(3, 4), mask), (torch.randn(3, 4), torch.tensor([[1, 1, 1]])),
                 (torch.randn(2, 4), torch.tensor([[0, 0, 1]]))):
        with torch.no_grad():
            errors.append((module(x, m) - model(x, m)).abs().max().item())
    return dict(errors=errors, specializations=list(module.specializations),
                first=dict(module.partitioned.traced.values))


def test_a_later_trace_that_reads_values_is_retraced_for_new_values(pools):
    """Traced at batch 2 without reading the mask; batch 3 reads it: that program is traced for the mask, and a
    second mask at batch 3 gets its own; batch 2 with any mask is the first program."""
    for result in pools[2].run(_retraced_for_values):
        assert max(result["errors"]) <= TOLERANCE, result
        assert result["first"] == {} and len(result["specializations"]) == 2, result


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
        assert result["error"] <= TOLERANCE and result["checked"] > 0, (rank, result)
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


class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class JointBuiltInPlace(torch.nn.Module):
    """Text and image rows each refined by their own attention, then written into one buffer at the text's valid
    length (``joint[:, :n] = text[:, :n]; joint[:, n:] = image``) for a joint attention."""

    def __init__(self):
        super().__init__()
        self.text, self.image, self.joint = _SelfAttention(), _SelfAttention(), _SelfAttention()

    def forward(self, x, text, mask):
        valid = int(mask.sum())
        text, image = self.text(text), self.image(x)
        joint = x.new_zeros(x.shape[0], valid + x.shape[1], x.shape[2])
        joint[:, :valid] = text[:, :valid]
        joint[:, valid:] = image
        joint = self.joint(joint)
        return joint[:, valid:], joint[:, :valid]


class TwoMaskedJointBlocks(torch.nn.Module):
    """The second block picks the valid rows of text that the first padded back: one run of rows, a slice."""

    def __init__(self):
        super().__init__()
        self.first, self.second = MaskedJointBlock(), MaskedJointBlock()

    def forward(self, x, text, mask):
        x, text = self.first(x, text, mask)
        return self.second(x, text, mask)


def _every_attention_sharded(rank, world, name, broken):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.passes import localize

    torch.manual_seed(0)
    model = {"in_place": JointBuiltInPlace, "two_blocks": TwoMaskedJointBlocks}[name]().eval()
    inputs = _inputs()
    block_offsets_kept = mock.patch.object(localize, "_localize_block_slice", lambda node, mesh: None)
    with torch.no_grad():
        expected = model(*inputs)
    with block_offsets_kept if broken else contextlib.nullcontext():
        try:
            partitioned = partition(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",)), (inputs, {}))
            error = _error(partitioned.compile()(*inputs), expected)
        except Exception as failure:  # noqa: BLE001 (rows written at global offsets do not fit a rank's part)
            if not broken:
                raise
            return dict(error=str(failure))
    checked = partitioned.verify(*inputs).nodes_checked if not broken else 0
    return dict(error=error, checked=checked, attention=dict(partitioned.ctx.sequence_attention))


@pytest.mark.parametrize("name", ["in_place", "two_blocks"])
def test_every_attention_of_a_joint_sequence_built_in_place_or_picked_by_a_run_is_sequence_sharded(pools, name):
    """Rows written into a whole buffer are a packed shard around them (each rank writes its part); rows picked by
    a constant run are a slice of whole packed blocks. Every attention runs sequence-sharded, exact."""
    for rank, result in enumerate(pools[2].run(_every_attention_sharded, name, False)):
        assert isinstance(result["error"], float) and result["error"] <= TOLERANCE, (rank, result)
        assert result["checked"] > 0 and result["attention"], result
        assert all(how.sharded for how in result["attention"].values()), result


def test_negative_control_rows_written_at_their_global_offsets_are_wrong(pools):
    results = pools[2].run(_every_attention_sharded, "in_place", True)
    assert any(isinstance(r["error"], str) or r["error"] > 1e-3 for r in results), results


@pytest.mark.parametrize("broken", ["order", "guard"])
def test_negative_control_without_the_reorder_or_the_value_guard_is_wrong(pools, broken):
    results = _run(pools, "ulysses2", broken)
    if broken == "order":  # the gathered rows left in rank order
        assert max(r["error"] for r in results) > 1e-3, results
    else:  # the program traced for one mask, run on another
        assert max(r["other_error"] for r in results) > 1e-3, results


class ReorderedTextJoint(torch.nn.Module):
    """The text rows reordered by their mask, valid rows first and the padded ones zeroed after them, before a
    joint attention masked by the reordered mask (HunyuanVideo 1.5's idiom: ``t[m]`` then ``t[~m]``, a boolean
    index of a float tensor by a bool input)."""

    def __init__(self):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.qkv, self.text_qkv = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor):
        mask = mask.bool()
        text = torch.stack([torch.cat([t[m], torch.zeros_like(t[~m])]) for t, m in zip(text, mask)])
        mask = torch.stack([torch.cat([m[m], m[~m]]) for m in mask])
        heads = lambda t: t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)  # noqa: E731
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        tq, tk, tv = (heads(t) for t in self.text_qkv(text).chunk(3, dim=-1))
        keys = torch.cat([torch.ones(x.shape[:2], dtype=torch.bool), mask], 1)[:, None, None, :]
        joint = F.scaled_dot_product_attention(torch.cat([q, tq], 2), torch.cat([k, tk], 2), torch.cat([v, tv], 2),
                                               attn_mask=keys)
        return self.out(joint.transpose(1, 2).flatten(2))


def _reordered(rank, world, mode, broken):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.frontend import value_specialization

    torch.manual_seed(0)
    model = ReorderedTextJoint().eval()
    x, text, _ = _inputs()
    mask = torch.tensor([[1, 0, 1, 1, 0, 1]])  # valid rows 0, 2, 3, 5: the reorder moves rows
    shape, names = MODES[mode]
    following = value_specialization.ValueShadow._masks_as_indices

    def reversed_rows(self, index, device):  # the negative control: the same rows picked in reverse order
        replaced, real = following(self, index, device)
        if real is None:
            return replaced, real
        return tuple(p.flip(0) if isinstance(p, torch.Tensor) else p for p in replaced), real

    with mock.patch.object(value_specialization.ValueShadow, "_masks_as_indices", reversed_rows) \
            if broken else contextlib.nullcontext():
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((x, text, mask), {}))
    with torch.no_grad():
        expected = model(x, text, mask)
        error = (partitioned.compile()(x, text, mask) - expected).abs().max().item()
    return dict(error=error, values={i: v.tolist() for i, v in partitioned.traced.values.items()},
                sharded=[p for p, why in partitioned.ctx.sequence_attention.items() if why.sharded])


@pytest.mark.parametrize("mode", ["ulysses2", "tp2xulysses2"])
def test_rows_reordered_by_their_mask_are_followed_and_exact(pools, mode):
    """Before: the trace for the mask's values still met a data-dependent size at the attention (``t[m]`` of a
    float tensor by the mask is sized by the mask's values). Now the mask's positions are constants of the trace:
    the joint attention is sequence-sharded and exact on every rank, pinned to this mask."""
    for rank, result in enumerate(_run_on(pools, _reordered, mode, False)):
        assert result["error"] <= TOLERANCE, (rank, result)
        assert result["values"] == {2: [[1, 0, 1, 1, 0, 1]]} and result["sharded"], result


def test_negative_control_rows_picked_at_other_positions_are_wrong(pools):
    results = _run_on(pools, _reordered, "ulysses2", True)
    assert min(r["error"] for r in results) > 1e-2, results


def _run_on(pools, case, mode, *args):
    return pools[2 if MODES[mode][0] == (2,) else 4].run(case, mode, *args)


class ImageOrTextOnly(torch.nn.Module):
    """A text-to-video / image-to-video switch decided in Python by whether a float input is all zeros (HunyuanVideo
    1.5's idiom): the image tokens' mask is made by a factory in each branch, the tokens are reordered by it (valid
    first, the rest zeroed) and join the latent rows in one attention masked by it."""

    def __init__(self):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.qkv, self.image_qkv = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, 3 * width)
        self.time = torch.nn.Linear(1, width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, image_embeds: torch.Tensor):
        image = self.image_qkv(image_embeds)
        if torch.all(image_embeds == 0):  # text to video: no image tokens attended
            image = image * 0.0
            mask = torch.zeros(image.shape[:2], dtype=torch.long)
        else:
            mask = torch.ones(image.shape[:2], dtype=torch.long)
        mask = mask.bool()
        image = torch.stack([torch.cat([t[m], torch.zeros_like(t[~m])]) for t, m in zip(image, mask)])
        mask = torch.stack([torch.cat([m[m], m[~m]]) for m in mask])
        heads = lambda t: t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)  # noqa: E731
        q, k, v = (heads(t) for t in (self.qkv(x + self.time(timestep[:, None, None]))).chunk(3, dim=-1))
        iq, ik, iv = (heads(t) for t in image.chunk(3, dim=-1))
        keys = torch.cat([torch.ones(x.shape[:2], dtype=torch.bool), mask], 1)[:, None, None, :]
        joint = F.scaled_dot_product_attention(torch.cat([q, iq], 2), torch.cat([k, ik], 2), torch.cat([v, iv], 2),
                                               attn_mask=keys)
        return self.out(joint.transpose(1, 2).flatten(2))


def _switch_inputs(image: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(1, ROWS, HEADS * HEAD_DIM, generator=g), torch.rand(1, generator=g)
    embeds = torch.randn(1, TEXT, HEADS * HEAD_DIM, generator=g) if image else torch.zeros(1, TEXT, HEADS * HEAD_DIM)
    return x, t, embeds


def _guarded(rank, world, mode, image, broken=False):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = ImageOrTextOnly().eval()
    shape, names = MODES[mode]
    partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names),
                            (_switch_inputs(image, seed=0), {}))
    module = partitioned.compile()

    def error(inputs, run):
        with torch.no_grad():
            return (run(*inputs) - model(*inputs)).abs().max().item()

    same_branch, other_branch = _switch_inputs(image, seed=1), _switch_inputs(not image, seed=2)
    result = dict(error=error(_switch_inputs(image, seed=0), module), pinned=dict(partitioned.traced.values),
                  guards=[str(g.read) for g in partitioned.traced.guards.guards],
                  explained=[line for line in partitioned.explain().splitlines() if line.startswith("guard: ")],
                  sharded=[p for p, why in partitioned.ctx.sequence_attention.items() if why.sharded])
    if broken:  # the negative control: the program run on the other branch's input, its guard dropped
        partitioned.traced.guards = None
        result["other_error"] = error(other_branch, module.program)
        return result
    result["same_branch_error"] = error(same_branch, module.program)  # new latents, timestep, embeds: not pinned
    try:
        module.program(*other_branch)
        result["program"] = "accepted"
    except InputError as refusal:
        result["program"] = str(refusal)
    result["other_error"] = error(other_branch, module)  # the module traces again for the other branch
    result["back_error"] = error(same_branch, module)  # and the first program serves the first branch again
    for _ in range(2):  # the other branch again: served by its program, not traced once more
        error(_switch_inputs(not image, seed=4), module)
    result["programs"] = len(module.partitions)
    from partitioner.frontend.value_guards import Guards

    replays, failed = [], Guards.failed
    Guards.failed = lambda self, flat: replays.append(id(self)) or failed(self, flat)
    try:  # each program's guards replayed once a call: to choose the program, not again to check the call
        error(same_branch, module)
    finally:
        Guards.failed = failed
    result["replays"] = len(replays), len(set(replays))
    result["specializations"] = list(module.specializations)
    diverged = _switch_inputs(image if rank == 0 else not image, seed=3)  # one rank's embeds take the other branch
    try:
        module.program(*diverged)
        result["diverged"] = "accepted"
    except InputError as refusal:
        result["diverged"] = str(refusal).splitlines()[0]
    return result


@pytest.mark.parametrize("image", [False, True], ids=["text_only", "image"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_branch_on_a_float_input_is_a_guard_and_exact(pools, mode, image):
    """A Python branch on a float input's values: traced for the example's branch, exact on every rank with the
    joint attention sequence-sharded; only the predicate is pinned (other latents, timestep and embeddings of the
    same branch run on the traced program); the other branch is refused by the program with an InputError naming the
    input and the model's line, and served by the drop-in module traced again; a rank whose input alone takes the
    other branch is refused on every rank."""
    for rank, result in enumerate(_run_on(pools, _guarded, mode, image)):
        assert result["pinned"] == {}, result
        assert result["guards"] == ["Tensor.__bool__ of image_embeds at test_value_specialization.py:"
                                    f"{ImageOrTextOnly.forward.__code__.co_firstlineno + 2} in forward: "
                                    "if torch.all(image_embeds == 0):  # text to video: no image tokens attended"]
        assert result["explained"] == [f"guard: {result['guards'][0]} (traced: {not image}); a call where it comes "
                                       "out otherwise is traced again"], result["explained"]
        for key in ("error", "same_branch_error", "other_error", "back_error"):
            assert result[key] <= TOLERANCE, (rank, key, result)
        assert "for this call's image_embeds, Tensor.__bool__ of image_embeds at test_value_specialization.py" \
            in result["program"] and "comes out otherwise" in result["program"], result["program"]
        assert len(result["specializations"]) == 1 and "otherwise" in result["specializations"][0], result
        assert result["programs"] == 2, result["programs"]  # (its key once had one guard's outcome too few)
        assert result["replays"] == (2, 2), result["replays"]
        assert "image_embeds" in result["diverged"], result["diverged"]
        if MODES[mode][1][-1] == "ulysses":
            assert result["sharded"], result


def test_negative_control_the_other_branch_without_its_guard_is_wrong(pools):
    results = _run_on(pools, _guarded, "ulysses2", True, True)
    assert min(r["other_error"] for r in results) > 1e-2, results
    assert max(r["error"] for r in results) <= TOLERANCE, results


def test_a_number_read_from_a_float_input_is_pinned_and_only_it():
    """``t.item() > 0.5``: Python compares the number, which the shadow cannot see; the number read is what is
    pinned (a call with another timestep is refused by the program, never run on the other branch)."""
    class BranchOnItem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.proj(x) * (2.0 if t.item() > 0.5 else 1.0)

    traced = _trace(BranchOnItem(), torch.randn(2, 4), torch.tensor(0.7))
    assert traced.values == {} and [g.expected for g in traced.guards.guards] == [pytest.approx(0.7)]
    assert traced.guards.failed([torch.randn(2, 4), torch.tensor(0.7)]) is None  # other latents: the same trace
    failed = traced.guards.failed([torch.randn(2, 4), torch.tensor(0.3)])
    assert failed is not None and re.search(r"Tensor.item of t at test_value_specialization.py:\d+ in forward",
                                            str(failed.read))


class _CutAtMaskLength(torch.nn.Module):
    """HunyuanVideo Framepack: the text rows (computed from weights) cut at the length counted from a float mask
    with the image rows' ones in front; ``mask.float()`` of a float mask is the mask itself."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, text, mask):
        mask = torch.cat([mask.new_ones((1, x.shape[1])), mask.float()], 1)
        lengths = mask.sum(dim=1, dtype=torch.int)
        rows = torch.cat([x, self.proj(text)], 1)[:, :lengths[0]]
        return self.out(rows).sum(1)


def test_a_cut_at_a_length_read_from_a_float_mask_is_a_guard():
    """The length is a slice bound torch reads in C++ (no ``__index__`` the shadow sees): it is read as a number, so
    the cut has a static size (it was a data-dependent size the host prologue refuses), and guarded: the traced
    inputs pass their own guard (a step that returns its argument, ``.float()``, once made the replay fail on
    them), another count is refused. The trace computes what the model does."""
    from partitioner.frontend.trace import trace

    model, x, text = _CutAtMaskLength(), torch.randn(1, 2, 8), torch.randn(1, 5, 8)
    mask, other = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    partition(model, {"tp": 2}, ((x, text, mask), {}), rank=0)  # (a DataDependentNumber before)
    traced = trace(model, ((x, text, mask), {}), specialize_values=True)
    assert traced.values == {} and [g.expected for g in traced.guards.guards] == [5], traced.guards.guards
    assert traced.guards.failed([x, text, mask]) is None
    assert "a slice bound of mask" in str(traced.guards.failed([x, text, other]).read)
    with torch.no_grad():
        assert torch.equal(_run_traced(traced, x, text, mask), model(x, text, mask))
    bounded = trace(_CutAtTruth(), ((x, mask), {}), specialize_values=True)  # a bool bound: read as 1, as replayed
    assert bounded.guards.failed([x, mask]) is None


class _CutAtTruth(torch.nn.Module):
    def forward(self, x, mask):
        return x[:, :(mask.sum() > 0)] * 2


def test_printing_a_float_input_reads_nothing(capsys):
    """``print(t)`` in forward shows the traced tensor, as export does, and neither pins nor guards the value (a
    guard on its text would trace the model again for every timestep)."""
    class Prints(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            print(f"timestep {t}", str(t))
            return self.proj(x) * t

    traced = _trace(Prints(), torch.randn(2, 4), torch.tensor(0.7))
    assert traced.values == {} and traced.guards is None or not traced.guards.guards
    assert "timestep" in capsys.readouterr().out


# --- what the shadow follows, and what it refuses (traced in this process) -------------------------------------------

def _trace(model, *inputs):
    from partitioner.frontend.trace import trace

    return trace(model, (inputs, {}))


def _run_traced(traced, *inputs):
    arguments = [inputs[gi.target] if gi.kind == "user" else traced.state[gi.target] for gi in traced.inputs]
    with torch.no_grad():
        return traced.graph_module(*arguments)[0]


class _ReadsAfterWritingInPlace(torch.nn.Module):
    def forward(self, x, mask):
        m = mask.clone()
        m[:, 0] = 0  # written from constants: the shadow writes its copy too
        m.add_(1)
        return x * m + int(m.sum())  # the graph computes m, Python reads its real sum


def test_in_place_writes_of_specialised_values_are_followed():
    x, mask = torch.randn(2, 4), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    traced = _trace(_ReadsAfterWritingInPlace(), x, mask)
    assert list(traced.values) == [1]
    assert torch.equal(_run_traced(traced, x, mask), _ReadsAfterWritingInPlace()(x, mask))


def test_a_value_written_from_other_inputs_into_a_read_tensor_is_refused():
    class MixedWrite(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, mask):
            m = mask.clone()
            m[:, 0] = self.proj(x)[:, 0] > 0  # the shadow cannot follow: a weight's values are not traced
            return x * int(m.sum())

    with pytest.raises(TraceError, match="writes in place into a tensor computed from mask, whose values the trace"):
        _trace(MixedWrite(), torch.randn(2, 4), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]))


def test_writes_through_another_view_or_by_a_random_fill_are_refused():
    """Roots are kept per storage: a view made with an unshadowed argument (``view_as``) still writes the read
    tensor's storage, and a random fill cannot be computed alongside."""
    class WritesThroughViewAs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(8))

        def forward(self, x, mask):
            m = mask.clone()
            m.view_as(self.w).add_(self.w.long())
            return x[: int(m.sum())]

    class RandomFill(torch.nn.Module):
        def forward(self, x, mask):
            m = mask.clone().float()
            m.bernoulli_(1.0)
            return x[: int(m.sum())]

    x, mask = torch.arange(8.0), torch.tensor([1, 1, 1, 0, 0, 0, 0, 0])
    for model in (WritesThroughViewAs(), RandomFill()):
        with pytest.raises(TraceError, match="writes in place into a tensor computed from mask"):
            _trace(model, x, mask)


def test_the_same_tensor_given_for_two_arguments_pins_both():
    class ReadsTheProduct(torch.nn.Module):
        def forward(self, x, mask, other):
            return x[: int((mask * other).sum())]

    mask = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0])
    traced = _trace(ReadsTheProduct(), torch.arange(8.0), mask, mask)
    assert sorted(traced.values) == [1, 2]


def test_an_input_written_through_a_view_is_refused():
    class WritesItsInput(torch.nn.Module):
        def forward(self, x, mask):
            n = int(mask.sum())
            mask.mT.zero_()
            return x * (n + int(mask.sum()))

    with pytest.raises(TraceError, match=r"mutates \['mask'\] through a view"):
        _trace(WritesItsInput(), torch.randn(2, 4), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]))


def test_only_inputs_whose_values_are_read_are_pinned_and_random_ops_stay_random():
    class ReadsMaskComputesWithIds(torch.nn.Module):
        def forward(self, x, mask, ids):
            noise = torch.rand_like(mask.float())  # a random op of the mask: never frozen into a constant
            return x * ids + noise * 0 + int(mask.sum())

    x, mask, ids = torch.randn(2, 4), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]), torch.tensor([[1, 2, 3, 4]] * 2)
    traced = _trace(ReadsMaskComputesWithIds(), x, mask, ids)
    assert list(traced.values) == [1]  # ids is computed with, not read: one program serves every ids
    assert any(n.target is torch.ops.aten.rand_like.default for n in traced.graph_module.graph.nodes)
    other_ids = torch.tensor([[5, 6, 7, 8]] * 2)
    assert torch.equal(_run_traced(traced, x, mask, other_ids), x * other_ids + 5)


def test_buckets_over_an_input_whose_values_are_read_are_refused():
    with pytest.raises(PartitionError, match=r"reads the values of \['mask'\].*which buckets pad"):
        partition(MaskedJointBlock(), {"tp": 1}, (_inputs(), {}), buckets={("mask", 1): [8]})
