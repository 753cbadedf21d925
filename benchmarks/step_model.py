"""The planner's physical step-time model against measured steps on this machine, in one run.

    python benchmarks/step_model.py [--repeats 5] [--layouts tp=1 tp=2 ulysses=2]

First this machine is calibrated (``partitioner calibrate``: float32 matmul rate, memory bandwidth, gloo
latency and bandwidth, every rank measuring at once). Then the mid-size MiniMax-H3 of ``tp_step.py`` (8 heads x 64,
hidden 512, 4 blocks, 2048 packed rows, float32) is partitioned over each layout, its rank graph costed on that
profile, and run eagerly on gloo ranks of one thread each (median of --repeats steps, barrier-synchronised).
It prints predicted and measured milliseconds, their ratio, and the speedups over tp=1 both ways: the model is
judged by whether it orders and sizes layouts as the machine does. Eager op dispatch (tens of microseconds an op)
is not in the model. Timings on a shared 2-core machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tp_step import MID, ROWS, _inputs, _model, _time  # noqa: E402  (the same mid-size model and timing)


def _mesh(text: str) -> dict[str, int]:
    return {axis: int(size) for axis, size in (item.split("=") for item in text.split(","))}


def _measure(rank: int, world: int, layout: dict, repeats: int, profile_json: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.planning import cost

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))
    model, inputs = _model(MID), _inputs(MID)
    partitioned = partitioner.partition(model, mesh, ((), inputs))
    compiled = partitioned.compile()
    step = lambda: compiled(**inputs)  # noqa: E731
    profile = cost.DeviceProfile(**json.loads(profile_json))
    predicted = cost.step_time(partitioned.graph_module, partitioned.mesh, profile)
    seconds = _time(step, repeats, dist.barrier if world > 1 else lambda: None)
    return dict(seconds=seconds, predicted=predicted.step_s, compute=predicted.compute_s,
                comm=predicted.exposed_comm_s)


def main() -> None:
    from partitioner.planning.calibrate import calibrate
    from partitioner.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=["tp=1", "tp=2", "ulysses=2"])
    args = parser.parse_args()

    profile = calibrate(threads=1)
    print(f"calibrated: {profile.matmul_tflops * 1e3:.1f} GFLOP/s matmul, {profile.memory_gbps:.1f} GB/s memory, "
          f"gloo {profile.local_gbps:.2f} GB/s, {profile.latency_us:.0f} us per message")
    print(f"MiniMax-H3 mid config: {MID['num_attention_heads']} heads x {MID['attention_head_dim']}, hidden "
          f"{MID['hidden_size']}, {MID['num_layers']} blocks, {sum(ROWS.values())} packed rows, float32, eager, "
          f"median of {args.repeats}")
    print(f"{'layout':12} {'predicted ms':>13} {'(compute':>9} {'comm)':>7} {'measured ms':>12} {'meas/pred':>10} "
          f"{'speedup pred':>13} {'speedup meas':>13}")
    rows = {}
    for text in args.layouts:
        layout = _mesh(text)
        ranks = run_ranks(math.prod(layout.values()), _measure, layout, args.repeats, profile.to_json())
        rows[text] = max(ranks, key=lambda r: r["seconds"])
    base = rows[args.layouts[0]]
    for text, r in rows.items():
        print(f"{text:12} {r['predicted'] * 1e3:13.1f} {r['compute'] * 1e3:9.1f} {r['comm'] * 1e3:7.1f} "
              f"{r['seconds'] * 1e3:12.1f} {r['seconds'] / r['predicted']:10.2f} "
              f"{base['predicted'] / r['predicted']:12.2f}x {base['seconds'] / r['seconds']:12.2f}x")


if __name__ == "__main__":
    main()
