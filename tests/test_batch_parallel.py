"""A batch axis ("dp", alias "cfg"): the batch split where it enters, nothing exchanged inside the graph, the
outputs gathered; composed with tp and ulysses. Exact on every rank against the unpartitioned model (float32,
1e-5 as in test_tp_numerics: the batch split itself reorders no sum)."""

from __future__ import annotations

import pytest
import torch

from partitioner import partition
from partitioner.decisions import BatchSplit
from partitioner.errors import PartitionError
from partitioner.testing import run_ranks
from partitioner.testing.models import flux_cfg_inputs, flux_inputs, tiny_flux

TOLERANCE = 1e-5


def _batch_parallel(rank, world, shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_flux(), flux_cfg_inputs()
    partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs))
    with torch.no_grad():
        expected = model(**inputs).sample
    got = partitioned.compile()(**inputs).sample
    return (got - expected).abs().max().item(), partitioned.collective_counts(), dict(partitioned.ctx.batch_split)


@pytest.mark.parametrize("shape, names", [((2,), ("dp",)), ((2, 2), ("cfg", "tp")),
                                          ((2, 2, 2), ("dp", "tp", "ulysses"))],
                         ids=["dp2", "cfg2xtp2", "dp2xtp2xulysses2"])
def test_batch_axis_is_exact_and_exchanges_only_the_outputs(shape, names):
    batch = names[0]
    for error, counts, split in run_ranks(len(shape) and int(torch.tensor(shape).prod()), _batch_parallel, shape,
                                          names):
        assert error <= TOLERANCE, error
        assert {kind for kind, axis in counts if axis == batch} == {"all_gather"}  # nothing inside the graph
        assert counts[("all_gather", batch)] == 1  # the one output, gathered
        assert split == dict.fromkeys(["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"],
                                      BatchSplit(True))
        if "tp" in names:
            assert counts[("all_reduce", "tp")] > 0


class _MixesBatchRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return self.proj(x) + self.proj(y).mean(0, keepdim=True)  # y's rows are averaged over the batch


def test_an_input_whose_batch_rows_are_mixed_is_not_split_and_explain_says_where():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    partitioned = partition(_MixesBatchRows(), {"dp": 2}, ((x, y), {}))
    assert partitioned.ctx.batch_split["x"] == BatchSplit(True)
    assert "not split" in partitioned.explain("y") and "mean" in partitioned.explain("y")


def test_a_batch_smaller_than_the_degree_is_refused_naming_both():
    with pytest.raises(PartitionError, match=r"a dp degree of 2 splits the batch, and this call's batch is 1"):
        partition(tiny_flux(), {"dp": 2}, ((), flux_inputs()))
