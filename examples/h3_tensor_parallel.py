"""Tensor-parallel MiniMax-H3 on local gloo ranks, checked against the single-device model.

    python examples/h3_tensor_parallel.py [--tp 2] [--dump-dir DIR]
    torchrun --nproc-per-node 2 examples/h3_tensor_parallel.py --tp 2

Every rank builds the same tiny random H3 (same seed), partitions it for its place on the mesh, runs it, and prints
the largest absolute difference of its outputs against the unpartitioned model. Rank 0 then prints the report.
"""

from __future__ import annotations

import argparse

import torch

import partitioner
from partitioner.testing import TINY_H3, h3_inputs, launch, tiny_h3


def run_rank(rank: int, world: int, dump_dir: str | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    partitioned = partitioner.partition(model, mesh, ((), inputs), dump_dir=dump_dir if rank == 0 else None)
    actual = partitioned.compile(backend="eager")(**inputs)
    return dict(video=float((actual.sample - expected.sample).abs().max()),
                audio=float((actual.audio_sample - expected.audio_sample).abs().max()),
                report=str(partitioned.report()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (local gloo processes)")
    parser.add_argument("--dump-dir", help="write rank 0's graph after every pass here")
    args = parser.parse_args()

    results = launch(args.tp, run_rank, args.dump_dir)
    if results is None:  # torchrun: rank 0 reports
        return
    print(f"tiny MiniMax-H3 {TINY_H3['num_attention_heads']} heads x {TINY_H3['attention_head_dim']}, "
          f"{TINY_H3['num_layers']} blocks, TP={args.tp}, float32")
    for rank, result in enumerate(results):
        print(f"rank {rank}: max |partitioned - single device|  video {result['video']:.2e}  "
              f"audio {result['audio']:.2e}")
    print(results[0]["report"])
    worst = max(max(r["video"], r["audio"]) for r in results)
    if worst > 1e-5:
        raise SystemExit(f"mismatch: {worst:.2e} > 1e-5")


if __name__ == "__main__":
    main()
