"""Ranks fail together, in bounded time, and a partition never runs on a message stream that is out of step.

Each case runs on local gloo ranks and checks every rank: a named error (the package's own classes) on every rank,
within a few seconds of the partition's timeout, and then the next good call exact against the single-device model
(or a clear PartitionUnusable where the call failed after its first collective).
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch

from partitioner import (CollectiveTimeout, InputError, PartitionError, PartitionUnusable, RankDisagreement,
                         partition)
from partitioner.testing import TINY_H3, attempt, h3_inputs, run_ranks, tiny_h3
from partitioner.annotations import annotation

TIMEOUT = 6.0  # seconds, every collective of these partitions
TOLERANCE = 1e-5  # float32, sharding reorders sums only (see test_tp_numerics)


@pytest.fixture(autouse=True)
def spawned_ranks(monkeypatch):
    """Ranks started as a job's are, each its own interpreter (spawn: its own string-hash seed and imports), not
    forked from the test session's server: agreement must hold between ranks that share nothing."""
    from partitioner.testing import ranks

    monkeypatch.setattr(ranks, "start_method", lambda: "spawn")


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _error(model, compiled, inputs) -> float:
    with torch.no_grad():
        return (compiled(**inputs).sample - model(**inputs).sample).abs().max().item()


def _bad_index_then_good(rank, world, preflight: bool):
    """Ulysses=2: a token tag out of range, the same on every rank. Per-row values are sliced by rank, so only the
    rank holding the bad row would fail inside the graph; the preflight catches it first on every rank."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    partitioned = partition(model, _mesh((world,), ("ulysses",)), ((), inputs), timeout=TIMEOUT)
    compiled = partitioned.compile()
    if not preflight:  # negative control: the checks that run before the first collective are switched off
        compiled.preflight.program = None
    bad = dict(inputs, token_tags=inputs["token_tags"].clone())
    bad["token_tags"][-1] = 7  # 2 timesteps x 3 tags: indices of the per-row table run to 5
    outcome = attempt(lambda: compiled(**bad))
    after = attempt(lambda: _error(model, compiled, inputs))
    return outcome, after, _error(model, compiled, inputs) if after[0] == "returned" else None


def test_bad_index_is_rejected_on_every_rank_and_the_next_call_is_exact():
    results = run_ranks(2, _bad_index_then_good, True)
    for rank, ((kind, message, seconds), _, error) in enumerate(results):
        assert kind == "InputError", (rank, kind, message)
        assert "rank(s) [0, 1] rejected this call" in message and "index out of range: 10 at position [22]" in message
        assert "from timestep_indices, token_tags" in message and "valid indices are in [0, 6)" in message
        assert seconds < TIMEOUT  # rejected before any collective could wait
        assert error <= TOLERANCE


def test_without_the_preflight_a_bad_index_breaks_the_partition():
    """Negative control: the rank with the bad row raises inside the graph, its peer waits in a collective until
    the timeout; neither runs another call on the now out-of-step message stream."""
    results = run_ranks(2, _bad_index_then_good, False)
    kinds = sorted(outcome[0] for outcome, _, _ in results)
    assert kinds == ["CollectiveTimeout", "IndexError"], kinds
    for outcome, after, _ in results:
        assert outcome[2] < TIMEOUT + 10
        assert after[0] == "PartitionUnusable" and "partition the model again" in after[1]


def _one_rank_rejects(rank, world):
    """TP=2: rank 1 is called with one text row too many; rank 0's call is good."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    compiled = partition(model, _mesh((world,), ("tp",)), ((), inputs), timeout=TIMEOUT).compile()
    call = dict(inputs)
    if rank == 1:
        call["encoder_hidden_states"] = torch.randn(1, 6, TINY_H3["text_dim"])
    outcome = attempt(lambda: compiled(**call))
    return outcome, _error(model, compiled, inputs)


def test_one_rank_rejecting_its_call_raises_on_every_rank():
    for rank, ((kind, message, seconds), error) in enumerate(run_ranks(2, _one_rank_rejects)):
        assert kind == "InputError", (rank, kind, message)
        assert "rank(s) [1] were called with other input shapes" in message
        assert "rank 1: " in message and "encoder_hidden_states[1, 6, 32]" in message
        assert seconds < TIMEOUT
        assert error <= TOLERANCE


def _plans_differ(rank, world, how: str):
    model = tiny_h3()
    inputs = h3_inputs(TINY_H3, text=6 if rank == 1 and how == "shapes" else 5)
    plan = {"proj_in": "diagonal"} if rank == 1 and how == "failure" else None
    plan = {"transformer_blocks.*.attn.to_out.0": "replicate"} if rank == 1 and how == "options" else plan
    if how == "layouts" and rank == 1:  # this rank's device lays every value out contiguously (another kernel)
        from partitioner.passes import device_layout

        device_layout.strides_on_device = lambda node, _: torch.empty(node.meta["val"].shape).stride()
    axis = "ulysses" if how == "layouts" else "tp"
    return attempt(lambda: partition(model, _mesh((world,), (axis,)), ((), inputs), plan=plan, timeout=TIMEOUT))


@pytest.mark.parametrize("how", ["shapes", "options", "layouts"])
def test_ranks_that_build_different_plans_refuse_together(how):
    for rank, (kind, message, seconds) in enumerate(run_ranks(2, _plans_differ, how)):
        assert kind == "RankDisagreement", (rank, kind, message)
        assert "rank(s) [1] differ from rank 0, first at decision" in message and "rank 1:" in message
        assert how != "layouts" or "all_to_all of permute: pieces in order" in message  # (q's exchange, first)
        assert seconds < 60


def test_a_rank_that_fails_to_partition_stops_every_rank():
    (kind0, message0, _), (kind1, message1, _) = run_ranks(2, _plans_differ, "failure")
    assert kind1 == "PartitionError" and "diagonal" in message1  # its own error, unchanged
    # (a RankDisagreement: every rank raises, and can fall back alike, as a VAE's decode does)
    assert kind0 == "FailedOnAnotherRank" and "rank(s) [1] failed to partition" in message0 and "diagonal" in message0


def _peer_fails_mid_call(rank, world):
    """TP=2, eager: rank 1 fails between two all_reduces (a test-side graph edit); rank 0 waits in the next one."""
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    partitioned = partition(model, _mesh((world,), ("tp",)), ((), inputs), timeout=TIMEOUT)
    compiled = partitioned.compile()
    if rank == 1:  # (the program that runs: the eager backend's copy, which settles the agreement)
        graph = compiled.lowered.graph
        reduce = [n for n in graph.nodes if annotation(n).collective == ("all_reduce", "tp")][3]
        with graph.inserting_before(reduce):
            graph.call_function(_injected_failure, ())
        compiled.lowered.recompile()
    failed = attempt(lambda: compiled(**inputs))
    again = attempt(lambda: compiled(**inputs))
    rebuilt = partition(model, _mesh((world,), ("tp",)), ((), inputs), timeout=TIMEOUT).compile()
    return failed, again, _error(model, rebuilt, inputs)


def _injected_failure():
    raise RuntimeError("injected failure")


def test_a_failure_inside_the_program_marks_the_partition_unusable_on_every_rank():
    (failed0, again0, error0), (failed1, again1, error1) = run_ranks(2, _peer_fails_mid_call)
    assert failed1[0] == "RuntimeError" and "injected failure" in failed1[1]
    assert failed0[0] == "CollectiveTimeout", failed0
    assert "all_reduce" in failed0[1] and "over mesh dim 'tp'" in failed0[1]
    assert TIMEOUT - 1 <= failed0[2] < TIMEOUT + 10
    for again in (again0, again1):
        assert again[0] == "PartitionUnusable" and again[2] < 1
    assert error0 <= TOLERANCE and error1 <= TOLERANCE  # a rebuilt partition runs exactly


def _agreement_overlaps(rank, world, settles: bool):
    """TP=2, eager: a good call (where its agreement is settled: inside the program, after compute); rank 0 rejects
    a call (an index out of range); the same with rank 1's program failing ahead of its settle point (a one-shot
    failure inserted there); a good call. ``settles=False``: the negative control, a program that skips the settle
    (the planned graph, with no settle node) yet claims to settle it, on the rejected call."""
    from partitioner.runtime import agreement

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    compiled = partition(model, _mesh((world,), ("tp",)), ((), inputs), timeout=TIMEOUT).compile()
    program = compiled.lowered
    point = next(n for n in program.graph.nodes if n.target is agreement.settle_pending)
    settled_from, settle = [], agreement.PendingAgreement._settle

    def spying(pending):
        settled_from.append([frame.f_code.co_name for frame, _ in traceback.walk_stack(None)][1:4])
        return settle(pending)

    agreement.PendingAgreement._settle = spying
    try:
        error = _error(model, compiled, inputs)
    finally:
        agreement.PendingAgreement._settle = settle
    call = dict(inputs)
    if rank == 0:
        call["token_tags"] = call["token_tags"].clone()
        call["token_tags"][-1] = 7  # out of range: rejected by rank 0's own checks
    if not settles:
        compiled.program.lowered = compiled.partitioned.graph_module
        compiled.partitioned.graph_module.settles_agreement = True
        return dict(outcome=attempt(lambda: compiled(**call)))
    refused = attempt(lambda: compiled(**call))
    if rank == 1:
        _FAILURES.append(True)
        with program.graph.inserting_before(point):
            program.graph.call_function(_fail_once, ())
        program.recompile()
    failed_first = attempt(lambda: compiled(**call))
    return dict(error=error, settled_from=settled_from, refused=refused, failed_first=failed_first,
                after=_error(model, compiled, inputs), settles_before=annotation(point.next).collective,
                compute_before_settle=sum(n.op == "call_function" for n in program.graph.nodes if n < point))


_FAILURES: list = []  # (a global: the graph's code would inline a list argument as a new literal every call)


def _fail_once() -> None:
    if _FAILURES:
        _FAILURES.pop()
        raise RuntimeError("injected failure ahead of the settle point")


def test_the_agreement_is_settled_inside_the_program_before_its_first_collective():
    for rank, result in enumerate(run_ranks(2, _agreement_overlaps, True)):
        assert result["error"] <= TOLERANCE and result["after"] <= TOLERANCE, rank  # usable throughout
        assert result["settles_before"] == ("all_reduce", "tp") and result["compute_before_settle"] > 5
        assert len(result["settled_from"]) == 1 and "forward" in result["settled_from"][0], result["settled_from"]
        for kind, message, seconds in (result["refused"], result["failed_first"]):
            assert kind == "InputError" and "rank(s) [0] rejected this call" in message, (rank, kind, message)
            assert seconds < TIMEOUT


def test_a_program_that_does_not_settle_the_agreement_first_breaks_a_refused_call():
    """The negative control: without the settle node rank 1 runs into its first all_reduce alone."""
    kind, message, seconds = run_ranks(2, _agreement_overlaps, False)[1]["outcome"]
    assert kind == "CollectiveTimeout" and seconds >= TIMEOUT - 1, (kind, message, seconds)


def _peer_never_calls(rank, world):
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    compiled = partition(model, _mesh((world,), ("tp",)), ((), inputs), timeout=TIMEOUT).compile()
    if rank == 1:
        time.sleep(TIMEOUT + 2)
        return None
    return attempt(lambda: compiled(**inputs))


def test_a_rank_that_never_calls_is_a_timeout_not_a_hang():
    kind, message, seconds = run_ranks(2, _peer_never_calls)[0]
    assert kind == "CollectiveTimeout" and "every rank must make every call" in message
    assert TIMEOUT - 1 <= seconds < TIMEOUT + 10


def _load_after_compile(rank, world, first: str, second: str):
    from diffusers import MiniMaxH3Transformer3DModel

    inputs = h3_inputs(TINY_H3)
    with torch.device("meta"):
        skeleton = MiniMaxH3Transformer3DModel(**TINY_H3).eval()
    partitioned = partition(skeleton, _mesh((world,), ("tp",)), ((), {k: v.to("meta") for k, v in inputs.items()}),
                            timeout=TIMEOUT)
    compiled = partitioned.load_weights(first).compile()
    errors = []
    for path, seed in ((first, 0), (second, 1)):
        partitioned.load_weights(path)
        errors.append(_error(tiny_h3(seed), compiled, inputs))
    return errors


def test_load_weights_after_compile_changes_what_the_compiled_partition_runs(tmp_path):
    tiny_h3(0).save_pretrained(tmp_path / "a")
    tiny_h3(1).save_pretrained(tmp_path / "b")
    for errors in run_ranks(2, _load_after_compile, str(tmp_path / "a"), str(tmp_path / "b")):
        assert max(errors) <= TOLERANCE, errors


def _short_text_at_ulysses4(rank, world):
    model, inputs = tiny_h3(), h3_inputs(TINY_H3, text=3)
    partitioned = partition(model, _mesh((world,), ("ulysses",)), ((), inputs), timeout=TIMEOUT)
    return partitioned.explain(), _error(model, partitioned.compile(), inputs)


def test_attention_shorter_than_the_sequence_degree_is_left_whole():
    """Ulysses=4 with a 3-row prompt: the text refiner's attention stays whole (explain says why), the main blocks
    are sequence-sharded, and every rank is exact."""
    for explanation, error in run_ranks(4, _short_text_at_ulysses4):
        lines = explanation.splitlines()
        assert "token_refiner.refiner_blocks.0.attn: not sequence-sharded" in explanation
        assert "sequence of 3 rows cannot be spread over a ulysses degree of 4" in explanation
        assert sum("transformer_blocks." in line and "sequence-sharded (Ulysses" in line for line in lines) == 2
        assert error <= TOLERANCE


def test_timeout_must_be_a_positive_number():
    with pytest.raises(InputError, match="timeout must be a positive number of seconds, got -1"):
        partition(tiny_h3(), {"tp": 2}, ((), h3_inputs(TINY_H3)), timeout=-1)


def test_errors_share_one_base_and_keep_builtin_compatibility():
    from partitioner import PartitionerError

    for error in (InputError, PartitionError, RankDisagreement, CollectiveTimeout, PartitionUnusable):
        assert issubclass(error, PartitionerError)
    assert issubclass(InputError, ValueError) and issubclass(CollectiveTimeout, RuntimeError)
