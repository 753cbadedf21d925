"""MiniMax-H3 with tensor parallelism and Ulysses sequence parallelism on one mesh, checked against one device.

    python examples/h3_tp_ulysses.py [--tp 2] [--ulysses 2] [--heads 6] [--dump-dir DIR]
    torchrun --nproc-per-node 4 examples/h3_tp_ulysses.py --tp 2 --ulysses 2

Every rank builds the same tiny random H3 (same seed), partitions it for its place on a (tp, ulysses) mesh, runs it,
and prints the largest absolute difference against the unpartitioned model. The packed sequence has 23 rows and the
default 6 heads leave 3 per tp rank, split 2 + 1 over Ulysses=2: uneven on purpose, nothing is padded.
"""

from __future__ import annotations

import argparse

import torch

import partitioner
from partitioner.testing import TINY_H3, h3_inputs, launch, tiny_h3


def run_rank(rank: int, world: int, tp: int, ulysses: int, heads: int, dump_dir: str | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(num_attention_heads=heads), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs)
    mesh = init_device_mesh("cpu", (tp, ulysses), mesh_dim_names=("tp", "ulysses"))
    partitioned = partitioner.partition(model, mesh, ((), inputs), dump_dir=dump_dir if rank == 0 else None)
    actual = partitioned.compile()(**inputs)
    return dict(video=float((actual.sample - expected.sample).abs().max()),
                audio=float((actual.audio_sample - expected.audio_sample).abs().max()),
                report=str(partitioned.report()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--dump-dir", help="write rank 0's graph after every pass here")
    args = parser.parse_args()

    results = launch(args.tp * args.ulysses, run_rank, args.tp, args.ulysses, args.heads, args.dump_dir)
    if results is None:  # torchrun: rank 0 reports
        return
    print(f"tiny MiniMax-H3 {args.heads} heads x {TINY_H3['attention_head_dim']}, {TINY_H3['num_layers']} blocks, "
          f"23 packed rows, TP={args.tp} x Ulysses={args.ulysses}, float32")
    for rank, result in enumerate(results):
        print(f"rank {rank} (tp {rank // args.ulysses}, ulysses {rank % args.ulysses}): max |partitioned - single "
              f"device|  video {result['video']:.2e}  audio {result['audio']:.2e}")
    print(results[-1]["report"])
    worst = max(max(r["video"], r["audio"]) for r in results)
    if worst > 1e-5:
        raise SystemExit(f"mismatch: {worst:.2e} > 1e-5")


if __name__ == "__main__":
    main()
