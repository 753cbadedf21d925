"""Data-dependent ops hoisted into a CPU prologue; a static device graph; numerics across denoising steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import partitioner
from partitioner import InputError, PartitionError, TraceError
from partitioner.errors import DataDependentNumber
from partitioner.testing import TINY_H3, H3DenoiseStep, denoise_inputs, run_ranks, tiny_h3

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# video, audio, video-conditioning, audio-reference timesteps of four steps: 1, 2, 3 and 4 distinct values
STEPS = {1: [0.5, 0.5, 0.5, 0.5], 2: [0.9, 0.9, 0.1, 0.1], 3: [0.7, 0.4, 0.1, 0.1], 4: [0.7, 0.5, 0.1, 0.2]}
MESHES = {"tp2": ((2,), ("tp",)), "tp2_u2": ((2, 2), ("tp", "ulysses"))}


def _steps(rank: int, world: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    step = H3DenoiseStep(tiny_h3())
    mesh = init_device_mesh("cpu", *MESHES[layout][:1], mesh_dim_names=MESHES[layout][1])
    compiled = partitioner.partition(step, mesh, ((), denoise_inputs(TINY_H3, STEPS[4]))).compile()
    results = {}
    for distinct, timesteps in STEPS.items():
        inputs = denoise_inputs(TINY_H3, timesteps)
        with torch.no_grad():
            results[distinct] = (step(**inputs), compiled(**inputs))
    return results


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_every_step_matches_single_device_without_retracing(layout):
    """One partition (traced at 4 distinct timesteps) serves steps with 1, 2, 3 and 4 distinct timesteps, on
    every rank, with TP and with TP x Ulysses."""
    world = int(torch.tensor(MESHES[layout][0]).prod())
    for results in run_ranks(world, _steps, layout):
        for distinct, (expected, actual) in results.items():
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, **TOLERANCE, msg=lambda m: f"{distinct} timesteps: {m}")


@pytest.fixture(scope="module")
def planned():
    return partitioner.partition(H3DenoiseStep(tiny_h3()), {"tp": 2, "ulysses": 2},
                                 ((), denoise_inputs(TINY_H3, STEPS[4])))


def test_device_graph_is_static_and_fed_by_explicit_transfers(planned):
    """No unbacked symbol and no data-dependent op is left on the device; the plan's distinct timesteps (padded to
    the torch._check bound 4) and per-row indices arrive as host transfers; step_timesteps is no device input."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in planned.graph_module.graph.nodes:
        val = node.meta.get("val")
        assert not (isinstance(val, torch.Tensor) and free_unbacked_symbols(val)), node.name
        assert node.target is not torch.ops.aten._unique2.default
    host = planned.ctx.host
    assert [(t.shape, t.sizes) for t in host.transfers] == [((4,), {0: "u0"}), ((23,), {})]
    assert planned.traced.values == {}  # hoisted, not specialised on the integer inputs' values
    assert "_unique2" in host.hoisted and "index_put" in host.hoisted  # functionalized: index_put_ -> index_put
    assert "_unique2: aten._unique2.default: output size depends on tensor values" in str(planned.report())
    kinds = [gi.kind for gi in planned.ctx.inputs]
    assert kinds.count("host") == 2
    step_index = list(denoise_inputs(TINY_H3, STEPS[4])).index("step_timesteps")
    assert step_index in host.inputs and ("user", step_index) not in [(gi.kind, gi.target) for gi in planned.ctx.inputs]


def test_dumps_show_prologue_and_device_graph(tmp_path):
    partitioner.partition(H3DenoiseStep(tiny_h3()), {"tp": 2}, ((), denoise_inputs(TINY_H3, STEPS[4])),
                          dump_dir=tmp_path)
    prologue = (tmp_path / "rank0" / "01_hoist_host.prologue.py").read_text()
    assert "_unique2" in prologue and "index_put" in prologue
    assert "_unique2" not in (tmp_path / "rank0" / "01_hoist_host.py").read_text()


def _over_bound(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    step = H3DenoiseStep(tiny_h3(), check_bound=False)
    compiled = partitioner.partition(step, mesh, ((), denoise_inputs(TINY_H3, STEPS[2])),
                                     bounds={"_unique2": 2}).compile()
    try:
        compiled(**denoise_inputs(TINY_H3, STEPS[3]))
    except InputError as error:
        return str(error)
    return "no error"


def test_more_distinct_values_than_the_bound():
    """3 distinct timesteps against a bound of 2 (given as an option): a clear error, nothing truncated."""
    (message,) = run_ranks(1, _over_bound)
    assert "3 entries along dim 0 (u0), more than the bound 2" in message and "bounds=" in message


def test_bound_defaults_to_what_export_knows():
    """Without torch._check, torch.unique's bound is the row count export derives (23): padded to it, still exact
    in structure."""
    planned = partitioner.partition(H3DenoiseStep(tiny_h3(), check_bound=False), {"tp": 2},
                                    ((), denoise_inputs(TINY_H3, STEPS[4])))
    assert planned.ctx.host.transfers[0].shape == (23,)


class Unbounded(nn.Module):
    def forward(self, x, counts):
        return x.index_select(0, torch.arange(counts.sum().item()) % x.shape[0])


def test_missing_bound_is_named():
    """A size export cannot bound (from .item()) is refused, naming the op and both ways to bound it."""
    with pytest.raises(PartitionError, match=r"item \(aten.item.default\) has a data-dependent size u0 with no upper "
                                             r"bound; add torch._check.*bounds=\{'item': k\}"):
        partitioner.partition(Unbounded(), {"tp": 1}, ((), dict(x=torch.randn(6), counts=torch.tensor([1, 2]))))


class Gather(nn.Module):
    """Rows picked by a data-dependent index, then processed row by row: padding is never read."""

    def __init__(self, op: str):
        super().__init__()
        self.op, self.proj = op, nn.Linear(8, 8)

    def forward(self, x, mask, counts):
        if self.op == "nonzero":
            index = torch.nonzero(mask).squeeze(1)
        elif self.op == "masked_select":
            index = torch.masked_select(torch.arange(mask.shape[0]), mask)
        elif self.op == "repeat_interleave":
            index = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
        else:  # item
            index = torch.arange(counts.sum().item())
        torch._check(index.shape[0] <= 6)
        rows = self.proj(x).relu()
        picked = rows.index_select(0, index)
        return picked.sum(dim=-1)  # per picked row: a data-dependent number of outputs


def _gather_ops(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {}
    for op in OPS:
        torch.manual_seed(0)
        model = Gather(op).eval()
        compiled = partitioner.partition(model, mesh, ((), GATHER_INPUTS[0])).compile()
        results[op] = [(model(**inputs), compiled(**inputs)) for inputs in GATHER_INPUTS]
    return results


OPS = ["nonzero", "masked_select", "repeat_interleave", "item"]
GATHER_INPUTS = [dict(x=torch.arange(48.0).reshape(6, 8) / 48, mask=torch.tensor(m, dtype=torch.bool),
                      counts=torch.tensor(c)) for m, c in (([1, 0, 1, 1, 0, 0], [1, 0, 2]),
                                                           ([0, 1, 0, 0, 0, 0], [3, 1, 2]))]


def test_each_data_dependent_op_is_hoisted_and_exact():
    """nonzero, masked_select, repeat_interleave with tensor repeats and item: each lands in the prologue; its
    result, padded to the torch._check bound, picks rows on the device (TP=2: the linear is sharded) and the
    data-dependent output is trimmed back. Exact for inputs with other counts than the traced ones."""
    for results in run_ranks(2, _gather_ops):
        for op, calls in results.items():
            for expected, actual in calls:
                assert actual.shape == expected.shape, op
                torch.testing.assert_close(actual, expected, **TOLERANCE)
    for op in OPS:
        planned = partitioner.partition(Gather(op).eval(), {"tp": 2}, ((), GATHER_INPUTS[0]))
        assert planned.ctx.host.trims == [(0, 0, "u0")] or op == "item", (op, planned.ctx.host.trims)


class Reduces(nn.Module):
    def forward(self, x, mask):
        picked = x.index_select(0, torch.nonzero(mask).squeeze(1))
        torch._check(picked.shape[0] <= 6)
        return picked.sum(dim=0)


def test_padding_that_would_change_a_result_is_refused():
    """Summing over the padded rows would add padding: refused, naming the op, rather than silently wrong."""
    inputs = dict(x=torch.randn(6, 8), mask=torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool))
    with pytest.raises(PartitionError, match=r"padded to a static bound, and sum.* would mix the padding"):
        partitioner.partition(Reduces(), {"tp": 1}, ((), inputs))


class CutsProjectedText(nn.Module):
    """A frame-packing DiT's text path: projected rows cut to a count, then a reshape of a permuted view (a clone
    whose contiguity export can only answer with a guard on the data-dependent size). The count comes from the
    mask (HunyuanVideo Framepack) or from the projected rows themselves (``by_rows``)."""

    def __init__(self, by_rows: bool = False):
        super().__init__()
        self.proj, self.by_rows = nn.Linear(8, 8), by_rows

    def forward(self, text, mask):
        projected = self.proj(text)
        kept = (projected[..., 0] > 0) if self.by_rows else mask
        rows = projected[:, : kept.sum(dim=1, dtype=torch.int)[0]]
        return rows.permute(0, 2, 1).reshape(rows.shape[0], -1)


def test_a_cut_of_a_computed_value_by_a_data_dependent_length_is_refused_by_name():
    """Counted from the mask, an input, the model is traced for the mask's values and partitions (it was refused
    before value specialisation read a slice bound). Counted from the projected rows, the count needs the weights
    on the host: refused naming the weight, not an InvariantError from the trace's clean-up (a guard on the
    unbacked size)."""
    inputs = dict(text=torch.randn(1, 5, 8), mask=torch.tensor([[1, 1, 1, 0, 0]]))
    refused = (DataDependentNumber, r"p_proj_weight \(proj\.weight\) is a model tensor read by data-dependent host "
                                    r"code; only forward arguments can feed the host prologue")
    if torch.__version__ < "2.13":  # (torch 2.9's export itself stops at the cut, naming the model: torch_xla's venv)
        refused = (TraceError, r"torch.export could not trace CutsProjectedText")
    with pytest.raises(refused[0], match=refused[1]):
        partitioner.partition(CutsProjectedText(by_rows=True), {"tp": 2}, ((), inputs))
    if torch.__version__ >= "2.13":
        partitioned = partitioner.partition(CutsProjectedText(), {"tp": 2}, ((), inputs), rank=0)
        assert torch.equal(partitioned.traced.values[1], inputs["mask"])


class StaticCapacityExperts(nn.Module):
    """Expert-choice routing with a fixed capacity, as NucleusMoE writes it: each expert takes its top rows, and the
    per-expert counts are read back from ``torch.full((experts,), capacity).tolist()``: numbers read from data
    export cannot see, though the forward builds them from constants alone."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(8, 3), nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        picked = self.router(x).topk(2, dim=0).indices.t().reshape(-1)
        counts = torch.full((3,), 2).tolist()
        outs = [expert(rows) for expert, rows in zip(self.experts, x[picked].split(counts))]
        return torch.zeros_like(x).index_add(0, picked, torch.cat(outs))


def _static_capacity(rank: int, world: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, x = StaticCapacityExperts().eval(), torch.randn(6, 8)
    planned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), ((), dict(x=x)))
    other = torch.randn(6, 8)
    return planned.ctx.host, [(planned.compile()(x=v) - model(x=v)).abs().max().item() for v in (x, other)]


def test_counts_built_from_constants_are_folded_into_static_sizes():
    """Was: DataDependentNumber (the counts' .item() reads). Folded at partition time: no host prologue, exact on
    every rank for another input too."""
    for host, errors in run_ranks(2, _static_capacity):
        assert host is None and max(errors) < 1e-6, (host, errors)


class CountsInAutocast(nn.Module):
    """Counts built from constants inside an autocast region (a subgraph the fold does not evaluate)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            counts = (torch.full((1, 3), 2.0) @ torch.ones(3, 3) / 3).round().long().reshape(-1).tolist()
        return torch.cat([rows * 2 for rows in self.proj(x).split(counts)])


def test_counts_the_fold_cannot_compute_keep_the_prologue_refusal():
    """Was (in review): an InvariantError from evaluating a subgraph call; now the prologue's own refusal."""
    with pytest.raises(DataDependentNumber, match="makes a data-dependent size"):
        partitioner.partition(CountsInAutocast().eval(), {"tp": 2}, ((), dict(x=torch.randn(6, 8))))
