"""The report's activation estimate (a liveness walk over the partitioned graph's values) against the peak the CPU
allocator measures during one forward pass, on a tiny and a mid-size H3, on one device and on gloo ranks."""

from __future__ import annotations

import pytest
import torch

import partitioner
from partitioner.planning.report import activation_peak
from partitioner.testing import TINY_H3, h3_inputs, peak_allocated_bytes, run_ranks, tiny_h3, traced_peak_bytes

# the mid-size H3 of benchmarks/tp_step.py: 8 heads x 64, hidden 512, 4 blocks, 2048 packed rows, float32
MID = dict(num_attention_heads=8, attention_head_dim=64, hidden_size=512, num_layers=4, num_refiner_layers=1,
           ffn_dim=1536, in_channels=16, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=512, freq_dim=256,
           time_embed_hidden_dim=512, time_embed_dim=256, rope_freq_dim=8)
MID_ROWS = dict(text=256, video=1728, audio=64)
TOLERANCE = 0.2  # the estimate models values and collective buffers, not kernel temporaries or allocator rounding


@pytest.mark.parametrize("config, rows", [(TINY_H3, dict(text=64, video=900, audio=60)), (MID, MID_ROWS)],
                         ids=["tiny", "mid"])
def test_single_device_estimate_within_20_percent(config, rows):
    """Measured 52.8 MiB against 52.9 estimated on the mid-size model. A view (chunk, getitem, transpose) keeps
    the storage it views alive: counting views as free after their base's last use read 23% low."""
    torch.set_num_threads(1)
    model, inputs = tiny_h3(**config), h3_inputs(config, **rows)
    measured = traced_peak_bytes(model, inputs)
    estimate = partitioner.partition(model, {"tp": 1}, ((), inputs)).report().activation_peak_bytes
    assert abs(estimate / measured - 1) <= TOLERANCE, (estimate, measured)


def _ranks(rank: int, world: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, inputs = tiny_h3(**MID), h3_inputs(MID, **MID_ROWS)
    partitioned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=(layout,)),
                                        ((), inputs))
    compiled = partitioned.compile()
    with torch.no_grad():
        compiled(**inputs, return_dict=False)
        # the least of three: a buffer freed on gloo's thread is never seen freed, so a pass can read high
        measured = min(peak_allocated_bytes(lambda: compiled(**inputs, return_dict=False)) for _ in range(3))
    return dict(measured=measured, estimate=partitioned.report().activation_peak_bytes)


@pytest.mark.parametrize("layout", ["tp", "ring"])
def test_rank_estimate_within_20_percent(layout):
    """Mid-size H3 at tp=2 and ring=2 on gloo ranks: every rank's estimate within 20% of its measured peak
    (measured: ring=2 26.5 MiB both; tp=2 within a few percent)."""
    for result in run_ranks(2, _ranks, layout):
        assert abs(result["estimate"] / result["measured"] - 1) <= TOLERANCE, result


def test_estimate_falls_with_every_sequence_degree():
    """Planned on meta tensors at 2048 rows: each ring or Ulysses degree doubling cuts the per-rank estimate by at
    least a third (values along the sequence shrink; what stays whole is the text refiner's rows and per-row
    index tables), and tensor parallelism on top cuts it further."""
    model, inputs = tiny_h3(**MID), h3_inputs(MID, **MID_ROWS)
    peaks = {}
    for layout in ({"tp": 1}, {"ulysses": 2}, {"ulysses": 4}, {"ring": 2}, {"ring": 4}, {"ring": 2, "ulysses": 2},
                   {"tp": 2, "ulysses": 4}):
        partitioned = partitioner.partition(model, layout, ((), inputs))
        peaks[tuple(layout.items())] = activation_peak(partitioned.graph_module, partitioned.ctx)
    one = peaks[(("tp", 1),)]
    for axis in ("ulysses", "ring"):
        assert peaks[((axis, 2),)] < 0.67 * one and peaks[((axis, 4),)] < 0.67 * peaks[((axis, 2),)], peaks
    assert peaks[(("ring", 2), ("ulysses", 2))] < 0.67 * peaks[(("ulysses", 2),)]
    assert peaks[(("tp", 2), ("ulysses", 4))] < peaks[(("ulysses", 4),)]
