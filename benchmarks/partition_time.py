"""Time to partition full-size MiniMax-H3 against tracing it, side by side in one run.

    python benchmarks/partition_time.py [--rows 37888] [--layouts tp=8 tp=8,ulysses=4]

The model is built on the meta device (no weights), traced once alone (``partitioner.frontend.trace``:
torch.export plus this package's functionalisation and value checks, what ``partition`` itself starts with), then
partitioned as rank 0 of each layout on PyTorch's fake process group (rank programs, as a DeviceMesh job plans
them). For each layout it prints the whole ``partition`` time and its parts: the trace inside it, every pass, and
what runs outside the passes (building the context, the rank's shards, the ranks' plan comparison). The ratio to
the trace alone is the figure issue 36 sets at most 1.5x; this machine's noise is a few percent between runs, so
compare ratios taken in one run, never absolute times across runs.
"""

from __future__ import annotations

import argparse
import time
import warnings


def _layout(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    pairs = [item.split("=") for item in text.split(",")]
    return tuple(int(size) for _, size in pairs), tuple(name for name, _ in pairs)


def main() -> None:
    import partitioner
    from partitioner.frontend.trace import trace
    from partitioner.planning import planner
    from partitioner.testing import fake_mesh

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=37888)
    parser.add_argument("--layouts", nargs="*", default=["tp=8", "tp=8,ulysses=4"])
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    model = planner.build_meta_model("minimax-h3")
    example = planner.example_inputs(model, args.rows)
    trace(model, example)  # warm: the first export pays for imports and dispatcher caches
    start = time.perf_counter()
    trace(model, example)
    traced_s = time.perf_counter() - start
    print(f"full-size MiniMax-H3, {args.rows} rows, meta weights: trace alone {traced_s:.2f} s")
    for layout in args.layouts:
        shape, names = _layout(layout)
        with fake_mesh(shape, names, 0) as mesh:
            start = time.perf_counter()
            partitioned = partitioner.partition(model, mesh, example)
            total = time.perf_counter() - start
        passes = dict(partitioned.ctx.pass_seconds)
        outside = total - traced_s - sum(passes.values())
        print(f"\n{layout}: partition {total:.2f} s = {total / traced_s:.2f}x the trace alone (target 1.5x)")
        print(f"  {'trace (as alone)':<24}{traced_s:7.2f} s")
        for name, seconds in sorted(passes.items(), key=lambda item: -item[1]):
            print(f"  {name:<24}{seconds:7.2f} s")
        print(f"  {'outside the passes':<24}{outside:7.2f} s")


if __name__ == "__main__":
    main()
