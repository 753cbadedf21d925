"""``Partitioned.verify``: a correct partition passes value by value; a broken rule is found at the node it breaks."""

from __future__ import annotations

import pytest
import torch

from partitioner import VerificationError, partition
from partitioner.placement import Replicate
from partitioner.rules import Decision
from partitioner.testing import TINY_H3, LikeOps, broken_rule, h3_inputs, run_ranks, tiny_h3


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _verify_h3(rank, world, names):
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    result = partition(model, _mesh((world,), names), ((), inputs)).verify(**inputs)
    return result.nodes_checked, result.max_error, result.output_error


@pytest.mark.parametrize("names", [("tp",), ("ulysses",)])
def test_a_correct_partition_verifies_value_by_value(names):
    for checked, max_error, output_error in run_ranks(2, _verify_h3, names):
        assert checked > 280  # every value of tiny H3's program (295 values), not just the outputs
        assert max_error <= 1e-5 and output_error <= 1e-5


class Normalised(LikeOps):
    """A feature sum between a column- and a row-wise linear (up, down): no rule may carry the column shard
    through it."""

    def forward(self, x):
        h = self.up(x)
        total = h.sum(-1, keepdim=True)
        return self.down(h / total)


def sum_claimed_whole(node, placements, axis_size):
    """The fault: a sum over a sharded dim claims its per-rank partial result is the whole sum."""
    source = node.args[0]
    return Decision(Replicate(), {source: placements.get(source, Replicate())})


def _verify_broken(rank, world):
    torch.manual_seed(0)
    model, x = Normalised().eval(), torch.randn(3, 8)
    with broken_rule(torch.ops.aten.sum.dim_IntList, sum_claimed_whole):
        partitioned = partition(model, _mesh((world,), ("tp",)), ((x,), {}))
    try:
        partitioned.verify(x)
    except VerificationError as error:
        return partitioned.linear_styles, str(error)
    return partitioned.linear_styles, None


def test_verify_names_the_node_a_broken_rule_made_wrong():
    for styles, message in run_ranks(2, _verify_broken):
        assert styles == {"up": "colwise", "down": "rowwise"}  # the fault let the column shard through the sum
        assert message is not None
        assert message.startswith("rank ") and ": sum_1 = sum.dim_IntList differs from the unpartitioned model" in message
        assert "test_verify.py" in message and "h.sum(-1, keepdim=True)" in message
        assert "tp=R (by plan_sharding)" in message


def test_without_the_fault_the_same_model_verifies():
    """The control: the real rule keeps `up` whole, and verify passes."""
    assert all(message is None for _, message in run_ranks(2, _verify_fixed))


def _verify_fixed(rank, world):
    torch.manual_seed(0)
    model, x = Normalised().eval(), torch.randn(3, 8)
    partitioned = partition(model, _mesh((world,), ("tp",)), ((x,), {}))
    partitioned.verify(x)
    return partitioned.linear_styles, None


def test_verify_needs_the_model_alive():
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    partitioned = partition(model, {"tp": 2}, ((), inputs))
    partitioned.source = lambda: None
    with pytest.raises(VerificationError, match="keep a reference to it"):
        partitioned.verify(**inputs)
