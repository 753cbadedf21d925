"""Ulysses sequence parallelism, alone and composed with TP, on real gloo ranks against the single-device model.

The sizes are awkward on purpose: the packed sequence has 23 rows (12 + 11 over 2 ranks, 6 + 6 + 6 + 5 over 4) and
the model 6 heads (2 + 2 + 1 + 1 over Ulysses=4; at TP=2 each tp rank holds 3, split 2 + 1). Nothing is padded.

Tolerance: a Ulysses rank computes its heads' attention over the whole sequence exactly as the single device does,
and linears and norms act row by row, so Ulysses alone changes no arithmetic: outputs are bit-identical (measured
0.0). Composed with TP, the row-parallel summation order changes as in test_tp_numerics (measured ~2e-7). One
tolerance for all: rtol = atol = 1e-5, justified there. The negative control (one exchange replaced by a local
rearrangement that communicates nothing) misses by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner.runtime import collectives
from partitioner.testing import TINY_H3, flux_inputs, h3_inputs, no_exchange, run_ranks, tiny_flux, tiny_h3

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
HEADS = 6
LAYOUTS = {"u2": ((2,), ("ulysses",)), "u4": ((4,), ("ulysses",)), "tp2_u2": ((2, 2), ("tp", "ulysses"))}


def _run(rank: int, world: int, shape, names, drop_exchange: bool) -> dict:
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(num_attention_heads=HEADS), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs))
    exchanges = [n for n in partitioned.graph_module.graph.nodes if n.target is collectives.all_to_all_start]
    main = [n for n in exchanges if "transformer_blocks" in list(n.meta["nn_module_stack"].values())[-1][0]]
    shapes = {n.args[0].name: (tuple(n.args[0].meta["val"].shape), tuple(next(iter(n.users)).meta["val"].shape))
              for n in main}
    if drop_exchange:
        exchanges[-1].target = no_exchange  # the last attention's output, back to sequence sharding
        partitioned.graph_module.recompile()
    actual = partitioned.compile()(**inputs, return_dict=False)
    return dict(expected=expected, actual=actual, report=partitioned.report(), shapes=shapes,
                sharded_at=partitioned.ctx.sequence_sharded_at)


def _flux(shape, names) -> dict:
    """Flux: the double-stream block splits its joint sequence into text and image rows after attention, which a
    sequence shard cannot carry into the next attention; the single-stream block's attention is sequence-sharded."""
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_flux(), flux_inputs()
    with torch.no_grad():
        expected = model(**inputs).sample
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs))
    return dict(expected=expected, actual=partitioned.compile()(**inputs).sample, report=partitioned.report(),
                stopped=partitioned.ctx.sequence_stopped)


class PartialRotary(nn.Module):
    """Wan's rotary, per sample: the first ``len(angles)`` rows rotated (in float64), the rest of the rows appended
    as they are (``q[i, rotated:]``: empty when the rotary covers the whole length, as it does here)."""

    def __init__(self, width: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x, angles):
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        rotated = angles.shape[0]
        q = torch.stack([torch.cat([(q[i, :rotated].double() * angles.cos()).float(), q[i, rotated:]])
                         for i in range(b)])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.out(y.transpose(1, 2).reshape(b, n, width))


def _partial_rotary(shape, names) -> dict:
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, x, angles = PartialRotary().eval(), torch.randn(1, 11, 16), torch.randn(11, 1, 4, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x, angles)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((x, angles), {}))
    return dict(expected=expected, actual=partitioned.compile()(x, angles),
                sharded_at=partitioned.ctx.sequence_sharded_at)


def _cases(rank: int, world: int, layout: str) -> dict:
    shape, names = LAYOUTS[layout]
    return dict(plain=_run(rank, world, shape, names, False), dropped=_run(rank, world, shape, names, True),
                flux=_flux(shape, names), partial_rotary=_partial_rotary(shape, names))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request):
    shape, _ = LAYOUTS[request.param]
    return request.param, run_ranks(int(torch.tensor(shape).prod()), _cases, request.param)


def test_every_rank_matches_single_device(layout):
    """Video and audio outputs of every rank equal the unpartitioned model's."""
    for cases in layout[1]:
        for actual, expected in zip(cases["plain"]["actual"], cases["plain"]["expected"]):
            torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_flux_matches_single_device(layout):
    for cases in layout[1]:
        flux = cases["flux"]
        torch.testing.assert_close(flux["actual"], flux["expected"], **TOLERANCE)
        # both blocks' attentions: the joint sequence packed from the text and image shards, split back after
        assert flux["report"].count("all_to_all") == 8


def test_rows_appended_empty_after_a_rotary_do_not_stop_the_sequence_shard(layout):
    """The rows a rotary leaves out (``q[i, n:]``, empty at the whole length: a slice along the sharded sequence)
    are dropped from their concatenation when tracing, so the sequence is sharded from the inputs on: every rank
    projects only its rows (it was sharded after the rotary, each rank projecting every row). Exact on every rank."""
    for cases in layout[1]:
        case = cases["partial_rotary"]
        torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE)
        assert case["sharded_at"] == ["angles", "x"], case["sharded_at"]


def test_without_one_exchange_fails(layout):
    """Negative control: replacing one all_to_all by a local rearrangement breaks the comparison."""
    for cases in layout[1]:
        actual, expected = cases["dropped"]["actual"][0], cases["dropped"]["expected"][0]
        assert (actual - expected).abs().max() > 1e-3


def test_exchanges_and_sharding_points(layout):
    """4 all_to_alls per attention (q, k, v to heads; output back to sequence), the text refiner's included (its
    rows gathered once after it, before they are packed), 2 all_gathers after the output heads; the packed sequence
    is built sharded (each rank gathers its rows: only the per-row tables of which
    source row lands where are sliced, at their source) and per-row inputs are sliced at their source."""
    name, results = layout
    blocks = TINY_H3["num_layers"]
    for rank, cases in enumerate(results):
        report = cases["plain"]["report"]
        assert report.count("all_to_all") == 4 * (blocks + TINY_H3["num_refiner_layers"])
        assert report.count("all_gather") == 3
        assert report.count("all_reduce") == (0 if name.startswith("u") else 11)
        assert cases["plain"]["sharded_at"] == ["encoder_hidden_states", "position_ids", "source_row_of", "source_row_of_1", "source_row_of_2",
                                                "timestep_indices", "token_tags"]


def test_uneven_heads_and_rows(layout):
    """Per-rank q shapes before and after the exchange follow the balanced split of heads and rows."""
    name, results = layout
    shape, names = LAYOUTS[name]
    ulysses = shape[names.index("ulysses")]
    tp = shape[0] if "tp" in names else 1
    rows = [23 // ulysses + (i < 23 % ulysses) for i in range(ulysses)]
    heads = [HEADS // tp // ulysses + (i < HEADS // tp % ulysses) for i in range(ulysses)]
    for rank, cases in enumerate(results):
        u = rank % ulysses
        before, after = next(v for k, v in cases["plain"]["shapes"].items() if k.startswith("permute"))
        assert before == (1, HEADS // tp, rows[u], 16) and after == (1, heads[u], 23, 16)


def _exchange_in_every_order(rank: int, world: int) -> dict:
    """A [batch, heads, rows, dim] value laid out as [batch, rows, heads, dim] (an attention's output), 5 rows and
    3 heads split unevenly over 2 ranks, moved from rows to heads and back in every order of its dims."""
    import itertools

    from torch.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cpu", (world,)).get_group().group_name
    whole = torch.arange(2 * 5 * 3 * 4, dtype=torch.float32).reshape(2, 5, 3, 4).permute(0, 2, 1, 3)
    rows, heads = [3, 2], [2, 1]
    mine = whole.split(rows, dim=2)[rank]
    results, views = {}, {}
    for order in itertools.permutations(range(4)):
        order = list(order)
        issued = collectives.all_to_all_start(mine, 1, 2, heads, rows, rank, order, group)
        by_heads = collectives.all_to_all_wait(issued, list(mine.shape), 1, 2, heads, rows, rank, order)
        issued = collectives.all_to_all_start(by_heads, 2, 1, rows, heads, rank, order, group)
        back = collectives.all_to_all_wait(issued, list(by_heads.shape), 2, 1, rows, heads, rank, order)
        results[tuple(order)] = (by_heads, back)
        # joined_in_place says exactly when the wait returns a view of what arrived
        predicted = collectives.joined_in_place(list(mine.shape), 1, 2, heads, rank, order)
        views[tuple(order)] = (by_heads._base.dim() == 1, predicted)  # a view of the flat received buffer
    return dict(results=results, whole=whole, mine=mine, views=views)


def test_every_order_an_exchange_travels_in_is_exact():
    """Pieces may travel in any order of the dims (both sides use the same): every order gives the same values,
    uneven on both dims; sent with the rows outermost, the joined rows are a view of what arrived (no copy)."""
    for rank, got in enumerate(run_ranks(2, _exchange_in_every_order)):
        whole, heads = got["whole"], [(0, 2), (2, 3)][rank]
        for order, (by_heads, back) in got["results"].items():
            assert torch.equal(by_heads, whole[:, heads[0]:heads[1]]), order
            assert torch.equal(back, got["mine"]), order
        assert all(actual == predicted for actual, predicted in got["views"].values()), got["views"]
        assert got["views"][(2, 0, 1, 3)] == (True, True)  # the joined dim (rows) first: no copy


def test_a_piece_split_off_the_outermost_dim_is_sent_without_a_copy():
    """The send buffer of a value split along its outermost non-unit dim is the value's own memory."""
    whole = torch.randn(1, 5, 3, 4)
    assert collectives._flat_concatenation(whole.split([3, 2], dim=1), whole, 1).data_ptr() == whole.data_ptr()
    for sizes in ([2, 1], [1, 1, 1]):  # along an inner dim: a copy, in the pieces' order (stacked when even)
        pieces = whole.split(sizes, dim=2)
        assert torch.equal(collectives._flat_concatenation(pieces, whole, 2),
                           torch.cat([piece.reshape(-1) for piece in pieces]))
