"""Fault injection: exactly one rank diverges, and every rank ends in a named error or an exact result.

Two gloo ranks stay alive across the cases (one ``RankPool``) and share one TP=2 partition of tiny H3 (buckets on
the timestep) until a case breaks it; each case makes one rank diverge (never both alike), checks the package error
on every rank, that it came within the partition's timeout plus a few seconds, and that the next good call (or a
partition made again) is exact against the single-device model on every rank. Negative controls show that the
checks can fail: with input fingerprints off, ranks called with other latents return a wrong result silently.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from partitioner import partition
from partitioner.testing import TINY_H3, RankPool, attempt, h3_inputs, tiny_h3

TIMEOUT = 5.0  # seconds, every collective of these partitions
SLACK = 8.0  # seconds past the timeout a case may take to end (a loaded 2-core machine)
# A rank that skips sleeps TIMEOUT + 3: past its peer's wait in the store, which polls (up to 1 s late); a rank
# arriving within that wait would simply join the call, as it should.
TOLERANCE = 1e-5  # float32, sharding reorders sums only (see test_tp_numerics)
BUCKETS = {"timestep": [2, 4]}
_STATE: dict = {}  # per rank process: the model, its inputs and reference output, the partition


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _error(inputs=None) -> float:
    """The largest difference of a good call from the single-device model."""
    inputs = inputs or _STATE["inputs"]
    with torch.no_grad():
        return (_STATE["compiled"](**inputs).sample - _STATE["reference"]).abs().max().item()


def _partition(world) -> float:
    model = _STATE["model"]
    _STATE["partitioned"] = partition(model, _mesh(world), ((), _STATE["inputs"]), buckets=BUCKETS, timeout=TIMEOUT)
    _STATE["compiled"] = _STATE["partitioned"].compile()
    return _error()


def _setup(rank, world):
    _STATE.clear()
    _STATE["model"], _STATE["inputs"] = tiny_h3(), h3_inputs(TINY_H3)
    with torch.no_grad():
        _STATE["reference"] = _STATE["model"](**_STATE["inputs"]).sample
    return _partition(world)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        assert max(ranks.run(_setup)) <= TOLERANCE
        yield ranks


def _assert_named(outcomes, kind: str, *fragments: str, timeout: float = 0.0) -> None:
    for rank, (outcome, message, seconds) in enumerate(outcomes):
        assert outcome == kind, (rank, outcome, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
        assert seconds < timeout + SLACK, (rank, seconds)


# ---- 1. a call rejected on one rank is rejected on every rank; the partition stays usable ----

def _one_rank_call(rank, world, how: str):
    inputs = dict(_STATE["inputs"])
    kwargs = {}
    if rank == 1 and how == "keyword":
        kwargs = {"guidance": 1.0}
    if rank == 1 and how == "missing":
        del inputs["token_tags"]
    if rank == 1 and how == "beyond bucket":
        inputs["timestep"] = torch.rand(5)
    if rank == 1 and how == "index":
        inputs["token_tags"] = inputs["token_tags"].clone()
        inputs["token_tags"][-1] = 7
    return attempt(lambda: _STATE["compiled"](**inputs, **kwargs)), _error()


@pytest.mark.parametrize("how, reason", [
    ("keyword", "got an unexpected keyword argument 'guidance'"),
    ("missing", "missing a required argument: 'token_tags'"),
    ("beyond bucket", "timestep"),
    ("index", "index out of range"),
])
def test_a_call_rejected_on_one_rank_is_rejected_on_every_rank(pool, how, reason):
    results = pool.run(_one_rank_call, how)
    _assert_named([outcome for outcome, _ in results], "InputError", "rank(s) [1] rejected this call", "rank 1: ",
                  reason)
    assert all(outcome[2] < TIMEOUT for outcome, _ in results)  # before any collective could wait
    assert max(error for _, error in results) <= TOLERANCE  # the next good call is exact


def _other_bucket(rank, world):
    """Rank 1 calls with 3 timesteps (bucket 4, a shape specialisation), rank 0 with the traced 2."""
    inputs = dict(_STATE["inputs"])
    if rank == 1:
        inputs["timestep"] = torch.rand(3)
    return attempt(lambda: _STATE["compiled"](**inputs)), _error()


def test_ranks_choosing_different_programs_refuse_together(pool):
    results = pool.run(_other_bucket)
    _assert_named([outcome for outcome, _ in results], "InputError", "rank(s) [1] were called with other input shapes")
    assert max(error for _, error in results) <= TOLERANCE


# ---- 4. rank-divergent inputs ----

def _divergent_latents(rank, world, fingerprint: str):
    _STATE["partitioned"].input_fingerprint = fingerprint
    inputs = dict(_STATE["inputs"])
    if rank == 1:  # the most common mistake: ranks seeded differently
        inputs["hidden_states"] = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(7))
    try:
        with torch.no_grad():
            outcome = attempt(lambda: _STATE.__setitem__("out", _STATE["compiled"](**inputs).sample))
        wrong = (_STATE.pop("out") - _STATE["reference"]).abs().max().item() if outcome[0] == "returned" else None
    finally:
        _STATE["partitioned"].input_fingerprint = "sample"
    return outcome, wrong, _error()


@pytest.mark.parametrize("fingerprint", ["sample", "full"])
def test_ranks_called_with_other_values_raise_on_every_rank(pool, fingerprint):
    results = pool.run(_divergent_latents, fingerprint)
    _assert_named([outcome for outcome, _, _ in results], "InputError", "rank(s) [1] were called with other input "
                  "values than rank 0", "hidden_states on rank(s) [1]", "rank 0: ", "rank 1: ")
    for outcome, _, error in results:
        assert "encoder_hidden_states on" not in outcome[1]  # only the input that differs is named
        assert error <= TOLERANCE


def test_negative_control_without_fingerprints_divergent_inputs_give_a_silent_wrong_result(pool):
    results = pool.run(_divergent_latents, "off")
    assert [outcome[0] for outcome, _, _ in results] == ["returned", "returned"]
    assert max(wrong for _, wrong, _ in results) > 1e-2  # what the fingerprint prevents
    assert max(error for _, _, error in results) <= TOLERANCE


def _divergent_mask(rank, world):
    """A model specialised on its mask's values (it reads them): rank 1 is called with another mask, of the same
    shape: named as other values of the mask, not as other shapes."""
    from test_value_specialization import MaskedJointBlock, _inputs

    torch.manual_seed(0)  # the same weights on every rank (earlier cases drew random numbers on rank 1 only)
    model = MaskedJointBlock().eval()
    x, text, mask = _inputs()
    compiled = partition(model, _mesh(world), ((x, text, mask), {}), timeout=TIMEOUT).compile()
    other = _inputs(pad=3)[2] if rank == 1 else mask
    outcome = attempt(lambda: compiled(x, text, other))
    with torch.no_grad():
        error = max((a - b).abs().max().item() for a, b in zip(compiled(x, text, mask), model(x, text, mask)))
    return outcome, error


def test_a_mask_whose_values_differ_between_ranks_is_named(pool):
    results = pool.run(_divergent_mask)
    _assert_named([outcome for outcome, _ in results], "InputError", "rank(s) [1] were called with other input "
                  "values than rank 0", "mask on rank(s) [1]")
    assert max(error for _, error in results) <= TOLERANCE


class _Adjustment:
    """A state object (a forward argument taken apart by its attributes): which attribute holds its tensor decides
    what the forward computes."""

    def __init__(self, **tensors):
        vars(self).update(tensors)


class _Adjusted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x, adjustment):
        return self.down(self.up(x * adjustment.scale if hasattr(adjustment, "scale") else x + adjustment.shift))


def _other_state_structure(rank, world):
    """Rank 1 passes its tensor as ``shift``, rank 0 as ``scale`` (the traced one): equal leaves, other structures.
    Rank 1 would trace again for its structure while rank 0 runs the traced program."""
    torch.manual_seed(0)
    model, x, factor = _Adjusted().eval(), torch.randn(2, 8), torch.randn(2, 8)
    compiled = partition(model, _mesh(world), ((x, _Adjustment(scale=factor)), {}), timeout=TIMEOUT).compile()
    outcome = attempt(lambda: compiled(x, _Adjustment(shift=factor) if rank == 1 else _Adjustment(scale=factor)))
    with torch.no_grad():
        error = (compiled(x, _Adjustment(scale=factor)) - model(x, _Adjustment(scale=factor))).abs().max().item()
    return outcome, error


def test_a_call_structure_is_described_without_addresses():
    """A defaultdict's factory and a type's context enter the signature by name (a TreeSpec's repr prints them with
    addresses, which differ on every rank: every call would be refused)."""
    import collections

    import torch.utils._pytree as pytree

    from partitioner.runtime.fingerprints import structure_key

    def factory():
        return 0

    spec = pytree.tree_flatten(((), dict(options=collections.defaultdict(factory, steps=torch.ones(2)))))[1]
    assert "0x" not in repr(structure_key(spec)) and "factory" in repr(structure_key(spec))


def test_ranks_whose_state_objects_differ_in_structure_refuse_together(pool):
    results = pool.run(_other_state_structure)
    _assert_named([outcome for outcome, _ in results], "InputError", "rank(s) [1] were called with other input "
                  "shapes, dtypes or options than rank 0", timeout=TIMEOUT)
    assert max(error for _, error in results) <= TOLERANCE


def _other_weights(rank, world):
    """Rank 1 builds its model unseeded (other random weights): the plan check compares sampled weights."""
    model = tiny_h3(seed=1) if rank == 1 else _STATE["model"]
    return attempt(lambda: partition(model, _mesh(world), ((), _STATE["inputs"]), buckets=BUCKETS,
                                      timeout=TIMEOUT)), _error()


def test_ranks_whose_models_hold_other_weights_refuse_to_partition(pool):
    results = pool.run(_other_weights)
    _assert_named([outcome for outcome, _ in results], "RankDisagreement", "rank(s) [1] differ from rank 0",
                  "model weights (sampled; every rank must build or load the same)", timeout=TIMEOUT)
    assert max(error for _, error in results) <= TOLERANCE  # the partition made before still runs exactly


# ---- 3. load_weights all or nothing ----

def _load(rank, world, paths: list[str], expect_seed: int):
    outcome = attempt(lambda: _STATE["partitioned"].load_weights(paths[rank]))
    if outcome[0] == "returned":
        _STATE["model"] = tiny_h3(expect_seed)
        with torch.no_grad():
            _STATE["reference"] = _STATE["model"](**_STATE["inputs"]).sample
    return outcome, _error()


def test_load_weights_failing_on_one_rank_loads_on_none(pool, tmp_path):
    tiny_h3(1).save_pretrained(tmp_path / "b")
    shutil.copytree(tmp_path / "b", tmp_path / "truncated")
    (file,) = (tmp_path / "truncated").glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])
    results = pool.run(_load, [str(tmp_path / "b"), str(tmp_path / "truncated")], 1)
    _assert_named([outcome for outcome, _ in results], "CheckpointError", "failed on rank(s) [1], so no rank loaded it",
                  "rank 1: ", str(file))
    assert max(error for _, error in results) <= TOLERANCE  # every rank kept the weights it had
    results = pool.run(_load, [str(tmp_path / "b")] * 2, 1)  # then the good file, on every rank
    assert [outcome[0] for outcome, _ in results] == ["returned", "returned"]
    assert max(error for _, error in results) <= TOLERANCE


# ---- 2. timeouts, and groups every rank agrees on after a fault ----

def _peer_skips_a_call(rank, world):
    if rank == 1:
        time.sleep(TIMEOUT + 3)
        outcome = None
    else:
        outcome = attempt(lambda: _STATE["compiled"](**_STATE["inputs"]))
    again = attempt(lambda: _STATE["compiled"](**_STATE["inputs"])) if rank == 0 else None
    return outcome, again, attempt(lambda: _partition(world)), _error()


def test_a_rank_that_skips_a_call_times_out_and_a_new_partition_is_exact(pool):
    """Only rank 0 sees the timeout; partitioning again, both ranks still create fresh groups (not one the old)."""
    (failed, again, rebuilt0, error0), (_, _, rebuilt1, error1) = pool.run(_peer_skips_a_call)
    assert failed[0] == "CollectiveTimeout" and "every rank must make every call" in failed[1]
    assert TIMEOUT - 1 <= failed[2] < TIMEOUT + SLACK
    assert again[0] == "PartitionUnusable" and "partition the model again" in again[1]
    assert rebuilt0[0] == rebuilt1[0] == "returned", (rebuilt0, rebuilt1)
    assert error0 <= TOLERANCE and error1 <= TOLERANCE


def _peer_skips_partition(rank, world):
    skipped = attempt(lambda: _partition(world)) if rank == 0 else time.sleep(TIMEOUT + 3)
    return skipped, attempt(lambda: _partition(world)), _error()


def test_a_rank_that_never_calls_partition_is_named_and_the_next_partition_is_exact(pool):
    (skipped, rebuilt0, error0), (_, rebuilt1, error1) = pool.run(_peer_skips_partition)
    assert skipped[0] == "CollectiveTimeout" and "rank(s) [1] did not call partition()" in skipped[1], skipped
    assert skipped[2] < TIMEOUT + SLACK
    assert rebuilt0[0] == rebuilt1[0] == "returned", (rebuilt0, rebuilt1)
    assert error0 <= TOLERANCE and error1 <= TOLERANCE


def _verify_on_one_rank(rank, world):
    if rank == 0:
        outcome = attempt(lambda: _STATE["partitioned"].verify(**_STATE["inputs"]))
        after = attempt(lambda: _STATE["compiled"](**_STATE["inputs"]))
    else:
        time.sleep(TIMEOUT + 3)
        outcome = after = None
    return outcome, after, attempt(lambda: _partition(world)), _error()


def test_verify_on_one_rank_marks_the_partition_unusable(pool):
    (outcome, after, rebuilt0, error0), (_, _, rebuilt1, error1) = pool.run(_verify_on_one_rank)
    assert outcome[0] == "CollectiveTimeout" and "every rank must call verify()" in outcome[1], outcome
    assert outcome[2] < TIMEOUT + SLACK
    assert after[0] == "PartitionUnusable"
    assert rebuilt0[0] == rebuilt1[0] == "returned", (rebuilt0, rebuilt1)
    assert error0 <= TOLERANCE and error1 <= TOLERANCE


# ---- 5. weak cases: package errors that name what is wrong ----

def _alike_call(rank, world, how: str):
    inputs = dict(_STATE["inputs"])
    if how == "timestep as list":
        inputs["timestep"] = inputs["timestep"].tolist()
    if how == "dtype":
        inputs["hidden_states"] = inputs["hidden_states"].double()
    return attempt(lambda: _STATE["compiled"](**inputs)), _error(), list(_STATE["compiled"].specializations)


def test_a_timestep_passed_as_a_list_names_the_argument(pool):
    for outcome, error, _ in pool.run(_alike_call, "timestep as list"):
        assert outcome[0] == "InputError", outcome
        assert "timestep must be a tensor (buckets pad it along dim 0), got list [0." in outcome[1]
        assert error <= TOLERANCE


def test_a_specialisation_for_another_dtype_is_named_by_it(pool):
    for outcome, error, specializations in pool.run(_alike_call, "dtype"):
        assert outcome[0] == "returned", outcome
        assert "hidden_states[1, 12, 16] float64 (traced: float32)" in specializations, specializations
        assert error <= TOLERANCE


def test_a_call_after_destroy_process_group_is_a_package_error(tmp_path):
    import torch.distributed as dist

    from partitioner import PartitionUnusable

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        compiled = partition(model, _mesh(1), ((), inputs), timeout=TIMEOUT).compile()
        with torch.no_grad():
            assert (compiled(**inputs).sample - model(**inputs).sample).abs().max() <= TOLERANCE
    finally:
        dist.destroy_process_group()
    with pytest.raises(PartitionUnusable, match="destroy_process_group.*partition the model again"):
        compiled(**inputs)


def test_plans_that_cannot_be_read_name_the_file_and_the_field(tmp_path):
    from partitioner import InputError, Plan
    from partitioner.decisions import LinearSharding, Style

    good = Plan({"tp": 2}, {"proj_in": "colwise"}).to_json()  # (a plan for any model: only read here)
    (tmp_path / "cut.json").write_text(good[:len(good) // 2])
    cases = {"": "give a plan file's path", str(tmp_path / "none.json"): "does not exist",
             str(tmp_path / "cut.json"): "is not valid JSON", str(tmp_path): "cannot be read",
             good.replace('"colwise"', '["colwise"]'): "'proj_in'.* is not a Linear decision",
             good.replace('"version": 2', '"version": 1'): "plan version 1 found its sequence seeds by fx node names",
             good.replace('"tp": 2', '"tp": "2"'): "field 'mesh'"}
    for source, message in cases.items():
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Plan.from_json(source)
    with pytest.raises(InputError, match="'proj_in'.*unit or block below 1"):
        Plan({"tp": 2}, {"proj_in": LinearSharding(Style.COLWISE, unit=0)}).linear_decisions()


def test_a_bad_index_json_is_a_checkpoint_error_naming_the_entry(tmp_path):
    import json

    from partitioner import CheckpointError
    from partitioner.runtime.checkpoint import load_shards
    from partitioner.mesh import as_mesh_spec

    tiny_h3().save_pretrained(tmp_path / "one")
    (file,) = (tmp_path / "one").glob("*.safetensors")
    index = tmp_path / "one" / "diffusion_pytorch_model.safetensors.index.json"
    tensor = next(iter(tiny_h3().state_dict().items()))
    expected = {tensor[0]: (tensor[1].shape, tensor[1].dtype)}
    index.write_text(json.dumps({"weight_map": {tensor[0]: file.name, "no.such": file.name}}))
    with pytest.raises(CheckpointError, match=f"no.such: the index maps it to {file.name}, which does not hold it"):
        load_shards(index, {**expected, "no.such": (tensor[1].shape, tensor[1].dtype)}, {}, as_mesh_spec({"tp": 1}), strict=False)
    index.write_text(json.dumps({"weight_map": [tensor[0]]}))
    with pytest.raises(CheckpointError, match="'weight_map' must map each tensor name to its file name, got list"):
        load_shards(index, expected, {}, as_mesh_spec({"tp": 1}))


def test_plan_lines_that_differ_late_are_shown_where_they_differ():
    from partitioner.runtime.agreement import _around_difference

    a, b = "x" * 1000 + "colwise" + "y" * 500, "x" * 1000 + "rowwise" + "y" * 500
    first, other = _around_difference(a, b)
    assert "colwise" in first and "rowwise" in other and first.startswith("...")
