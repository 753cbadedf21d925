"""Model idioms beyond H3 and Flux, each checked on real gloo ranks against the single device: the ways people
write fused projections, joint attention, masks and reshapes must plan correctly or refuse clearly."""

from __future__ import annotations

import pytest
import torch

import partitioner
from partitioner.testing import idiom_cases as _cases, run_ranks

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _run(rank: int, world: int, axis: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    results = {}
    for name, (factory, inputs) in _cases().items():
        torch.manual_seed(0)
        model = factory().eval()
        with torch.no_grad():
            expected = model(**inputs)
        partitioned = partitioner.partition(model, mesh, ((), inputs))
        results[name] = dict(expected=expected, actual=partitioned.compile()(**inputs),
                             styles=partitioned.linear_styles, report=partitioned.report(),
                             stopped=partitioned.ctx.sequence_stopped)
    return results


@pytest.fixture(scope="module")
def tp():
    return run_ranks(2, _run, "tp")


@pytest.fixture(scope="module")
def ulysses():
    return run_ranks(2, _run, "ulysses")


@pytest.mark.parametrize("axis", ["tp", "ulysses"])
@pytest.mark.parametrize("name", sorted(_cases()))
def test_every_rank_matches_single_device(request, axis, name):
    for results in request.getfixturevalue(axis):
        torch.testing.assert_close(results[name]["actual"], results[name]["expected"], **TOLERANCE)


def test_tensor_parallel_plans(tp):
    """Fused projections cut with `split` are packed column shards; joint attention shards both streams."""
    case = tp[0]
    assert case["split_sizes"]["styles"]["proj"] == "colwise packed [16, 16]"
    assert case["split_size"]["styles"]["proj"] == "colwise packed [16, 16]"
    assert case["joint_unflatten"]["styles"] == {"qkv_a": "colwise packed [32, 32, 32]",
                                                 "qkv_b": "colwise packed [32, 32, 32]", "out": "rowwise"}


def test_sequence_parallel_plans(ulysses):
    """An odd row count split by view still gets Ulysses (3 + 2 rows); a masked attention gets it too, its
    (per-head) mask whole and cut to each rank's heads (its exactness is checked above)."""
    case = ulysses[0]
    assert case["view_heads_odd_rows"]["report"].count("all_to_all") == 4
    assert case["masked"]["report"].count("all_to_all") == 4
