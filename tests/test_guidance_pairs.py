"""Classifier-free guidance on a cfg axis for pipelines that call the denoiser once per branch (runtime/guidance_pairs).

Real diffusers pipelines (tiny, random, their own encoders, VAEs and schedulers, 3 steps) on gloo ranks: Wan (prompt
and negative prompt padded alike) and Qwen-Image (true CFG: a prompt and a negative prompt of other lengths, so the
two calls of a step run programs of other shapes), at cfg=2, cfg=2 x tp=2 and cfg=2 x ulysses=2 (the request scenarios
below at cfg=2). Every step's latents and the decoded output are compared with the unpartitioned pipeline on every
rank (1e-4: float32, the tp and ulysses sums reordered; cfg alone computes the same ops, and its latents are bitwise
equal). From the second step on both calls run at once (2 pairs, 2 calls served of 6); every served output is bitwise
the output of the same call computed alone afterwards. A request with another negative prompt, at another size, a
guidance scale of 1 (one call a step), a step callback that edits the latents in place, and two requests in a row stay
exact. The negative control swaps the halves' outputs: the latents then differ.
"""

from __future__ import annotations

import math

import pytest
import torch

from partitioner.runtime.guidance_pairs import GuidancePairs, predict, same_value
from partitioner.testing import RankPool

TOLERANCE = 1e-4
MODES = {"cfg2": ((2,), ("cfg",)), "cfg2xtp2": ((2, 2), ("cfg", "tp")), "cfg2xulysses2": ((2, 2), ("cfg", "ulysses"))}
CASES = [("wan", "cfg2"), ("qwen_image", "cfg2"), ("wan", "cfg2xtp2"), ("qwen_image", "cfg2xulysses2")]
NEGATIVE = {"wan": "negative_prompt", "qwen_image": "negative_prompt"}
SCALE = {"wan": "guidance_scale", "qwen_image": "true_cfg_scale"}


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


def test_the_second_call_is_predicted_by_value():
    """Equal in both calls of the last pair: this call's value (a fresh timestep tensor each call, equal in value);
    differed: the last pair's second call's (the negative prompt's embedding)."""
    first = dict(x=torch.ones(2), t=torch.tensor([0.5]), text=torch.zeros(3), flag=True)
    second = dict(x=torch.ones(2), t=torch.tensor([0.5]), text=torch.full((3,), 7.0), flag=True)
    now = dict(x=torch.full((2,), 2.0), t=torch.tensor([0.25]), text=torch.zeros(3), flag=True)
    predicted = predict(first, second, now)
    assert predicted["x"] is now["x"] and predicted["t"] is now["t"] and predicted["flag"] is True
    assert predicted["text"] is second["text"]


def test_values_are_compared_not_objects():
    assert same_value(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    assert not same_value(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert not same_value(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert same_value({"scale": 1.5, "mask": None}, {"scale": 1.5, "mask": None})
    assert not same_value({"scale": 1.5}, {"scale": 2.0})
    assert not same_value(object(), object())  # an unknown object equals only itself


def _model(x, t, text, scale=1.0):
    """A stand-in denoiser whose output depends on every argument."""
    return x * 2 + t * 10 + text.mean() * scale


class _OneProcess(GuidancePairs):
    """The pairing protocol in one process: a pair computes both calls here, an agreement is a no-op."""

    def __init__(self):
        import contextlib
        import inspect
        from types import SimpleNamespace

        self.module = self
        self.signature, self.where, self.size, self.coordinate = inspect.signature(_model), "test", 2, 0
        self.pair = self.last = self.last_difference = self.held = None
        self.calls = self.served = self.paired = 0
        self.partitioned = SimpleNamespace(weights_version=0, mesh=SimpleNamespace(device_type="cpu"), trainable=False,
                                           trained_parameters=dict)
        self.training = False
        self.guard = SimpleNamespace(exclusive=contextlib.nullcontext)

    def __call__(self, *args, **kwargs):  # (as the module)
        return _model(*args, **kwargs)

    programs = True  # whether every call finds a program (False: a prediction would need a specialisation)

    def call_pair(self, first, second, member):
        if not self.programs:  # (as PartitionedModule.call_pair: the first call alone)
            return _model(*first[0], **first[1]), False
        self.pending = [_model(*call[0], **call[1]) for call in (first, second)]
        return self.pending[member], True

    def _exchange(self, mine):
        return self.pending

    def _agree_served(self, named):
        pass


def _steps(pairs, steps, branches=("cond", "uncond"), texts=None, named=True, x=None):
    """A denoising loop making one call per branch a step; every output checked against the model's."""
    texts = texts or {"cond": torch.ones(3), "uncond": torch.zeros(3)}
    x = torch.ones(2) if x is None else x
    for step in range(steps):
        t = torch.tensor(1.0 - step / steps)  # a fresh tensor every call, as pipelines make them
        outputs = []
        for branch in branches:
            args = (x, t.clone(), texts[branch])
            out = pairs.call(args, {}, branch if named else None)
            assert torch.equal(out, _model(*args)), (step, branch)
            outputs.append(out)
        x = x - 0.1 * sum(outputs)  # a new tensor: the scheduler's step
    return x


@pytest.mark.parametrize("named", [True, False], ids=["branches-named", "values-only"])
def test_the_pattern_is_learnt_from_names_or_values_and_every_output_is_the_models(named):
    pairs = _OneProcess()
    _steps(pairs, 4, named=named)
    assert (pairs.paired, pairs.served) == (3, 3)  # from the second step on
    _steps(pairs, 3, named=named, texts={"cond": torch.ones(3), "uncond": torch.full((3,), 5.0)})
    assert pairs.served == 3 + 2  # another negative prompt: its first step misses
    served = pairs.served
    _steps(pairs, 4, branches=("cond",), named=named)  # guidance scale 1: one call a step
    _steps(pairs, 3, branches=("cond", "uncond", "skip"), named=named,
           texts={"cond": torch.ones(3), "uncond": torch.zeros(3), "skip": torch.full((3,), 2.0)})
    assert pairs.served - served <= 3  # whatever is served, every output above was the model's


@pytest.mark.parametrize("change", ["weights", "mode", "autocast", "gradients"])
def test_a_change_of_state_after_the_pair_ran_is_not_served_stale(change):
    """Weights loaded, another mode, autocast or a call recording gradients between the two calls: the second is
    computed (here the stub's model ignores them; what is checked is that nothing was served)."""
    pairs = _OneProcess()
    x = _steps(pairs, 2)
    t, cond, uncond = torch.tensor(0.25), torch.ones(3), torch.zeros(3)
    pairs.call((x, t, cond), {}, "cond")
    assert pairs.held is not None
    served = pairs.served
    if change == "weights":
        pairs.partitioned.weights_version += 1
    elif change == "mode":
        pairs.training = True
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pairs.call((x, t, uncond), {}, "uncond")
    elif change == "gradients":
        pairs.call((x.requires_grad_(), t, uncond), {}, "uncond")
    else:
        pairs.call((x, t, uncond), {}, "uncond")
    assert pairs.served == served


def test_a_prediction_without_a_program_is_not_paired():
    pairs = _OneProcess()
    pairs.programs = False
    _steps(pairs, 4)
    assert (pairs.paired, pairs.served) == (0, 0)


def test_negative_zero_is_not_zero():
    assert not same_value(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_value(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert same_value(z.conj(), torch.tensor([1 - 2j, 3 + 1j])) and not same_value(z.conj(), z)
    assert same_value(torch.ones(2, dtype=torch.complex32), torch.ones(2, dtype=torch.complex32))
    assert same_value(torch.ones(3, 2).t(), torch.ones(2, 3)) and same_value(torch.tensor(1.5), torch.tensor(1.5))


def test_an_edit_in_place_after_the_pair_ran_is_not_served_stale():
    pairs = _OneProcess()
    x = _steps(pairs, 2)
    t, cond, uncond = torch.tensor(0.25), torch.ones(3), torch.zeros(3)
    first = pairs.call((x, t, cond), {}, "cond")  # the second call is computed ahead now
    assert pairs.held is not None and torch.equal(first, _model(x, t, cond))
    x.mul_(0.5)  # the pipeline edits the latents in place before its second call
    served = pairs.served
    assert torch.equal(pairs.call((x, t, uncond), {}, "uncond"), _model(x, t, uncond))
    assert pairs.served == served


class _Recorder:
    """Stands in for the stand-in's ``GuidancePairs``: records each call and whether it was served."""

    def __init__(self, pairs):
        self.pairs, self.served = pairs, []

    def call(self, args, kwargs, context):
        before = self.pairs.served
        output = self.pairs.call(args, kwargs, context)
        if self.pairs.served > before:
            self.served.append((args, kwargs, output))
        return output

    def __getattr__(self, name):
        return getattr(self.pairs, name)


def _pairs_on_ranks(rank, world, name, shape, names, swap=False, scenarios=True):
    import partitioner
    from partitioner.runtime.guidance_pairs import GuidancePairs
    from partitioner.testing.pipelines import BUILDERS, CALLS, run
    from torch.distributed.device_mesh import init_device_mesh

    def errors(got, expected):
        return [(a - b).abs().max().item() for a, b in zip(got[0] + [got[1]], expected[0] + [expected[1]])]

    pipe = partitioner.parallelize(BUILDERS[name](), init_device_mesh("cpu", shape, mesh_dim_names=names))
    reference = BUILDERS[name]()
    exchange = GuidancePairs._exchange
    if swap:  # the negative control: each half's output taken for the other's
        GuidancePairs._exchange = lambda self, mine: exchange(self, mine)[::-1]
    try:
        result = dict(first=errors(run(pipe, name), run(reference, name)))
    finally:
        GuidancePairs._exchange = exchange
    if swap:
        return result
    pairs = pipe.transformer.guidance_pairs
    result["counts"] = (pairs.calls, pairs.paired, pairs.served)
    if not scenarios:
        return result
    recorder = _Recorder(pairs)
    pipe.transformer.__dict__["_pairs"] = recorder
    other = {NEGATIVE[name]: "ugly and low quality"}
    served_before = pairs.served
    result["other negative prompt"] = errors(run(pipe, name, **other), run(reference, name, **other))
    result["served with another negative prompt"] = pairs.served - served_before
    served_before = pairs.served
    from partitioner.testing.pipelines import OTHER_SIZE  # another size: the first prediction has no program

    result["other size"] = errors(run(pipe, name, **OTHER_SIZE[name]), run(reference, name, **OTHER_SIZE[name]))
    result["served at another size"] = pairs.served - served_before
    served_before = pairs.served
    one_call = {SCALE[name]: 1.0}
    result["guidance scale 1"] = errors(run(pipe, name, **one_call), run(reference, name, **one_call))
    result["served at scale 1"] = pairs.served - served_before

    def halve(pipeline, step, timestep, tensors):  # edits the latents in place
        tensors["latents"].mul_(0.5)
        return {}

    edited = dict(CALLS[name], num_inference_steps=3, output_type="pt", callback_on_step_end=halve,
                  callback_on_step_end_tensor_inputs=["latents"])
    outputs = [p(**edited, generator=torch.Generator().manual_seed(0)) for p in (pipe, reference)]
    outputs = [o.frames if hasattr(o, "frames") else o.images for o in outputs]
    result["callback edits latents"] = (outputs[0] - outputs[1]).abs().max().item()
    result["served when edited"] = pairs.served - served_before
    module = pipe.transformer._module  # every served output against the same call computed alone
    result["served"] = len(recorder.served)
    result["bitwise"] = all(
        all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(output),
                                              torch.utils._pytree.tree_leaves(module(*args, **kwargs))))
        for args, kwargs, output in recorder.served)
    return result


@pytest.mark.parametrize("name, mode", CASES, ids=[f"{name}-{mode}" for name, mode in CASES])
def test_two_call_guidance_runs_both_calls_at_once_and_stays_exact(pools, name, mode):
    shape, names = MODES[mode]
    scenarios = names == ("cfg",)  # (the other axes change nothing in how calls pair)
    for rank, result in enumerate(pools[math.prod(shape)].run(_pairs_on_ranks, name, shape, names, False,
                                                              scenarios)):
        assert max(result["first"]) <= TOLERANCE, (rank, result)
        assert result["counts"] == (6, 2, 2), (rank, result["counts"])  # calls, pairs, served
        if not scenarios:
            continue
        assert max(result["first"][:-1]) == 0, (rank, result["first"])  # the latents: bitwise
        for case in ("other negative prompt", "guidance scale 1", "other size"):
            assert max(result[case]) <= TOLERANCE, (rank, case, result[case])
        assert result["callback edits latents"] <= TOLERANCE, (rank, result)
        assert result["served at scale 1"] == 0, (rank, result)
        # another negative prompt misses once, at the first step; an edit of the latents between steps never does
        assert result["served with another negative prompt"] == 2 and result["served when edited"] == 2, (rank, result)
        assert result["served at another size"] == 2, (rank, result)  # its first step specialises, computed alone
        assert result["served"] >= 3 and result["bitwise"], (rank, result)


def test_negative_control_swapping_the_halves_is_wrong(pools):
    for rank, result in enumerate(pools[2].run(_pairs_on_ranks, "wan", (2,), ("cfg",), True)):
        assert max(result["first"][:-1]) > 1e-3, (rank, result)


def _dp_over_one_call_per_branch(rank, world):
    import partitioner
    from partitioner.errors import PartitionError
    from partitioner.testing.pipelines import BUILDERS, run
    from torch.distributed.device_mesh import init_device_mesh

    pipe = partitioner.parallelize(BUILDERS["wan"](), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    try:
        run(pipe, "wan")
    except PartitionError as error:
        return str(error), pipe.transformer.is_partitioned
    return None, pipe.transformer.is_partitioned


def test_a_dp_axis_over_one_call_per_guidance_branch_is_refused_at_the_first_call(pools):
    """dp splits each call's batch; over batch-1 calls its ranks would compute the same rows (cfg pairs them)."""
    for message, partitioned in pools[2].run(_dp_over_one_call_per_branch):
        assert not partitioned and message is not None
        assert message.startswith("WanPipeline.transformer: the mesh's dp=2 axis splits the batch"), message
        assert "calls WanTransformer3DModel with a batch of 1 (hidden_states[1, 4, 2, 4, 4])" in message
        assert "Drop 'dp' from the mesh" in message
