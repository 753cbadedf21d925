"""A factorised video block (Latte's layout): attention within each frame, frames folded into the batch, then
across frames at each position, positions folded into the batch, then cross-attention to text rows repeated for
every frame (``partitioner.testing.SpatialTemporalBlock``).

Every value carrying the video rows carries two kinds of rows (positions and frames), so no value has one row dim
(``sequence_dims``: ambiguous). The sequence is split once, at the first such value, along its outermost row dim
(frames): the attention within each frame and the cross-attention run on each rank's own frames (batch entries,
no communication), the attention across frames exchanges them (Ulysses) or passes them round the ring. Before,
Ulysses split nothing in this block and ring left the attention across frames whole; Latte reported its
frame-local attentions as whole while running them split.

Tolerance 1e-5: Ulysses changes no arithmetic; ring attention merges blocks with their log-sum-exps (~1e-7 in
float32, as test_ring). The negative control replaces the frame exchange with a local rearrangement.
"""

from __future__ import annotations

import pytest
import torch

from partitioner.testing import RankPool, SpatialTemporalBlock, no_exchange

TOLERANCE = 1e-5
MESHES = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}}


def _case(rank, world, mesh, batch, broken):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner import partition
    from partitioner.runtime import collectives

    torch.manual_seed(0)
    model = SpatialTemporalBlock(frames=4, positions=6).eval()
    x, text = torch.randn(batch * 4, 6, 32), torch.randn(batch, 5, 16)
    device_mesh = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    partitioned = partition(model, device_mesh, ((x, text), {}))
    if broken:  # every exchange a local rearrangement of this rank's own rows
        for node in partitioned.graph_module.graph.nodes:
            if node.target is collectives.all_to_all_start:
                node.target = no_exchange
        partitioned.graph_module.recompile()
    with torch.no_grad():
        expected = model(x, text)
    got = partitioned.compile()(x, text)
    return dict(error=(got - expected).abs().max().item(),
                kinds={where: str(decided) for where, decided in partitioned.ctx.sequence_attention.items()},
                collectives={f"{k}:{a}": n for (k, a), n in partitioned.collective_counts().items()})


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as two:
        yield two


@pytest.mark.parametrize("mesh", list(MESHES))
def test_frame_local_and_cross_frame_attentions_are_split_and_exact(pool, mesh):
    results = pool.run(_case, MESHES[mesh], 1, False)
    assert all(r["error"] <= TOLERANCE for r in results), results
    kinds = results[0]["kinds"]
    assert kinds["spatial"].startswith("sequence-sharded (by whole batch entries"), kinds
    assert kinds["temporal"].startswith("sequence-sharded (Ulysses" if mesh == "ulysses2" else
                                        "sequence-sharded (ring"), kinds
    assert all(kind.startswith("sequence-sharded") for kind in kinds.values()), kinds


def test_two_videos_in_a_batch(pool):
    """Two videos of 4 frames: the outer dim of ``[2 * 4, positions, dim]`` no longer carries the frames alone (a
    rank's half would be one video), so the positions are its one row dim and split: the attention within each
    frame exchanges them, the attention across frames too; exact, every attention split."""
    results = pool.run(_case, MESHES["ulysses2"], 2, False)
    assert all(r["error"] <= TOLERANCE for r in results), results
    kinds = results[0]["kinds"]
    assert all(kind.startswith("sequence-sharded") for kind in kinds.values()), kinds


def test_negative_control_without_the_frame_exchange_is_wrong(pool):
    results = pool.run(_case, MESHES["ulysses2"], 1, True)
    assert max(r["error"] for r in results) > 100 * TOLERANCE, results
