"""Sequence parallelism at the lengths users bring: parts of any length, decisions from the graph's dims (never from
sizes), attention of one sequence over another, grouped-query attention, and plan() == partition().

The model of our own (``TwoStreams``) has what the zoo's tiny inputs never show together: a joint text + video
self-attention whose parts have different remainders over the degree, an audio self-attention with grouped key/value
heads (``enable_gqa``), and audio queries attending over the video rows (queries and keys from different
sequences). Every rank is compared with the single-device model (float32, sums reordered: 1e-5 of the output's
magnitude, as test_tp_numerics), and every attention must be sequence-sharded: an exact run that shards nothing is
no parallelism. A negative control leaves the joint sequence's rows in rank order after the exchange (it must be
wrong), so the exactness checks can fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import PartitionWarning, partition, plan
from partitioner.plans import Plan
from partitioner.testing import RankPool, fake_mesh

HEADS, HEAD_DIM, KV_HEADS = 4, 8, 2
WIDTH = HEADS * HEAD_DIM


class TwoStreams(nn.Module):
    """Video rows joined with text rows in one self-attention, audio rows with their own grouped-query
    self-attention, then audio queries over video keys and values."""

    def __init__(self):
        super().__init__()
        self.video_in, self.text_in, self.audio_in = nn.Linear(6, WIDTH), nn.Linear(5, WIDTH), nn.Linear(3, WIDTH)
        self.joint_qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.joint_out = nn.Linear(WIDTH, WIDTH)
        self.audio_q = nn.Linear(WIDTH, WIDTH)
        self.audio_kv = nn.Linear(WIDTH, 2 * KV_HEADS * HEAD_DIM)
        self.audio_out = nn.Linear(WIDTH, WIDTH)
        self.cross_q, self.cross_k, self.cross_v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.cross_out = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    @staticmethod
    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)

    def forward(self, video, text, audio):
        v, t, a = self.video_in(video), self.text_in(text), self.audio_in(audio)
        joint = torch.cat([t, v], 1)
        q, k, val = (self.heads(x) for x in self.joint_qkv(self.norm(joint)).chunk(3, -1))
        joint = joint + self.joint_out(F.scaled_dot_product_attention(q, k, val).transpose(1, 2).flatten(2))
        t, v = joint.split([text.shape[1], video.shape[1]], 1)
        ak, av = (self.heads(x) for x in self.audio_kv(a).chunk(2, -1))
        attended = F.scaled_dot_product_attention(self.heads(self.audio_q(a)), ak, av, enable_gqa=True)
        a = a + self.audio_out(attended.transpose(1, 2).flatten(2))
        crossed = F.scaled_dot_product_attention(self.heads(self.cross_q(a)), self.heads(self.cross_k(v)),
                                                 self.heads(self.cross_v(v)))
        a = a + self.cross_out(crossed.transpose(1, 2).flatten(2))
        return v.sum(-1, keepdim=True) + 0 * a.sum(), a


def two_streams(video: int, text: int, audio: int, seed: int = 0):
    torch.manual_seed(seed)
    model = TwoStreams().eval()
    g = torch.Generator().manual_seed(seed)
    return model, dict(video=torch.randn(1, video, 6, generator=g), text=torch.randn(1, text, 5, generator=g),
                       audio=torch.randn(1, audio, 3, generator=g))


def _two_streams_case(rank, world, shape, names, rows, sabotage=False):
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = two_streams(*rows)
    with torch.no_grad():
        expected = model(**inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartitionWarning)  # every attention sharded: no warning
        partitioned = partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs))
    if sabotage:
        _skip_reordering(partitioned.graph_module)
    actual = partitioned.compile()(**inputs)
    error = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    scale = max(e.abs().max().item() for e in expected)
    return error / max(scale, 1.0), dict(partitioned.ctx.sequence_attention), partitioned.report().attentions_sharded


def _skip_reordering(gm: torch.fx.GraphModule) -> None:
    """Negative control: the first attention's query rows, as the packed exchange delivers them (rank by rank),
    reversed: keys no longer permuted like the queries, so any row-order slip of the exchange would look alike."""
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    with gm.graph.inserting_before(node):
        flipped = gm.graph.call_function(torch.ops.aten.flip.default, (node.args[0], [2]))
    node.replace_input_with(node.args[0], flipped)
    gm.recompile()


@pytest.fixture(scope="module")
def ranks():
    with RankPool(4) as four:
        yield four


# video, text and audio rows with different remainders over 2, 3 and 4 ranks
ODD = (13, 7, 10)


@pytest.mark.parametrize("shape,names", [((2,), ("ulysses",)), ((4,), ("ulysses",)), ((2, 2), ("tp", "ulysses")),
                                         ((2,), ("ring",))], ids=["ulysses2", "ulysses4", "tp2xulysses2", "ring2"])
def test_parts_of_any_length_cross_sequence_and_grouped_heads_are_sharded_and_exact(ranks, shape, names):
    import math

    results = ranks.run(_two_streams_case, shape, names, ODD) if math.prod(shape) == 4 else \
        _run_two(shape, names, ODD)
    for rank, (error, attention, counted) in enumerate(results):
        assert error <= 1e-5, (rank, error)
        assert counted == (3, 3), attention
        assert all(how.sharded for how in attention.values()), attention


def _run_two(shape, names, rows):
    from partitioner.testing import run_ranks

    return run_ranks(2, _two_streams_case, shape, names, rows)


def test_rows_out_of_order_are_wrong(ranks):
    """Negative control: one attention's query rows reversed after the exchange must not pass as exact."""
    results = ranks.run(_two_streams_case, (4,), ("ulysses",), ODD, True)
    assert all(error > 1e-3 for error, _, _ in results), [r[0] for r in results]


def test_a_part_shorter_than_the_degree_is_still_sharded(ranks):
    """3 text rows over 4 ranks: one rank holds none of them; the joint attention is still sharded."""
    results = ranks.run(_two_streams_case, (4,), ("ulysses",), (9, 3, 6))
    for error, attention, counted in results:
        assert error <= 1e-5 and counted == (3, 3), (error, attention)


# --- lengths equal to the model's own sizes ----------------------------------------------------------------------

def _model_sizes(model: nn.Module) -> list[int]:
    """Every size the model has (its weights' dims, head counts and head dims), with multiples and halves: the
    lengths a size-based decision would mistake for a feature width."""
    sizes = {d for p in model.parameters() for d in p.shape}
    config = getattr(model, "config", {})
    sizes |= {v for k, v in dict(config).items() if isinstance(v, int) and not isinstance(v, bool)
              and ("head" in k or "dim" in k)}
    return sorted({s for base in sizes if base > 1 for s in (base, 2 * base, base // 2) if 2 <= s <= 256})


def _flux(rows: int, text: int):
    from partitioner.testing.zoo import build, inputs
    return build("flux"), inputs("flux", text=text, height=2, width=2 * rows)


def _qwen_image(rows: int, text: int):
    from partitioner.testing.zoo import build, inputs
    return build("qwen_image"), inputs("qwen_image", text=text, height=2, width=2 * rows)


def _h3(rows: int, text: int):
    from partitioner.testing import TINY_H3, h3_inputs, tiny_h3
    return tiny_h3(), ((), h3_inputs(TINY_H3, text=text, video=rows, audio=max(2, rows // 3)))


BUILDERS = {"flux": _flux, "qwen_image": _qwen_image, "minimax_h3": _h3}


def _planned(name: str, rows: int, text: int, degree: int) -> dict:
    model, example = BUILDERS[name](rows, text)
    with fake_mesh((degree,), ("ulysses",), 0) as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore", PartitionWarning)
        return plan(model, mesh, example).attention


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def coinciding_lengths(draw):
    name = draw(st.sampled_from(sorted(BUILDERS)))
    sizes = _model_sizes(BUILDERS[name](8, 5)[0])
    rows = draw(st.sampled_from([s for s in sizes if s <= 160]))
    text = draw(st.sampled_from([s for s in sizes if s <= 64]))
    return name, rows, text, draw(st.sampled_from([2, 4]))


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=coinciding_lengths())
def test_a_length_equal_to_a_model_size_changes_no_decision(case):
    """Image rows and text lengths drawn from the model's own sizes (head counts, head_dim, widths, their multiples
    and halves) shard every attention, as a length that coincides with nothing does."""
    name, rows, text, degree = case
    attention = _planned(name, rows, text, degree)  # (a Plan's attention lines: text, read-only)
    assert all(how.startswith("sequence-sharded") for how in attention.values()), (case, attention)


def _coinciding_case(rank, world, name, rows, text):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.testing.zoo_check import _first_tensor

    model, (args, kwargs) = BUILDERS[name](rows, text)
    with torch.no_grad():
        expected = _first_tensor(model(*args, **kwargs))
    partitioned = partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)), (args, kwargs))
    actual = _first_tensor(partitioned.compile()(*args, **kwargs))
    return (actual - expected).abs().max().item() / max(1.0, expected.abs().max().item()), \
        partitioned.report().attentions_sharded


@pytest.mark.parametrize("name,rows,text", [("flux", 64, 16), ("flux", 16, 64), ("qwen_image", 64, 4),
                                            ("minimax_h3", 48, 16)])
def test_coinciding_lengths_are_exact_on_every_rank(ranks, name, rows, text):
    """Rows equal to the inner width (64 = 4 heads x 16), text equal to head_dim, rows equal to the hidden size:
    every attention sharded, exact on every rank (Ulysses=4)."""
    for error, (sharded, total) in ranks.run(_coinciding_case, name, rows, text):
        assert error <= 1e-5 and sharded == total, (error, sharded, total)


def test_plan_is_the_decision_partition_takes():
    """plan() and partition() share one path: on a DeviceMesh (PyTorch's fake process group here) and on axis sizes
    (which plan the same rank programs) the Plan is exactly Plan.of(partition(...)); each model on one of the
    meshes (Ulysses, TP x Ulysses, ring), so that every axis kind is met."""
    from partitioner.testing.zoo import build, inputs

    for name, shape, names in (("flux", (2,), ("ulysses",)), ("minimax_h3", (2, 2), ("tp", "ulysses")),
                               ("hunyuan_video", (2,), ("ring",))):
        model, example = build(name), inputs(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PartitionWarning)
            with fake_mesh(shape, names, 0) as mesh:
                assert plan(model, mesh, example) == Plan.of(partition(model, mesh, example)), (name, names)
            sizes = dict(zip(names, shape))
            assert plan(model, sizes, example) == Plan.of(partition(model, sizes, example)), (name, names)
