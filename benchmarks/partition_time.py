"""Time to partition full-size MiniMax-H3 against torch.export alone, side by side in one run.

    python benchmarks/partition_time.py [--rows 37888] [--layouts tp=8 tp=8,ulysses=4] [--repeats 2] [--search 64]

The model is built on the meta device (no weights). Timed, each the fastest of ``--repeats`` after one warm-up
trace (the first export pays for imports and dispatcher caches):
  torch.export alone      ``torch.export.export(model, (), kwargs)``, what issue 36's 1.5x is measured against;
  trace alone             ``partitioner.frontend.trace``: export plus this package's clean-up, what ``partition``
                          starts with;
  partition, per layout   rank 0 of the layout on PyTorch's fake process group (rank programs, as a DeviceMesh job
                          plans them), with its parts: every pass, and what runs outside the passes (building the
                          context, copying the planned graph, the rank's shards, the plan the ranks compare).
``--search N`` also times the planner's search over every (tp, ring, ulysses) layout of N devices
(``python -m partitioner report --search``: layouts costed from cuts of the repeated blocks, pruned by a compute
bound, over this machine's cores), from one trace and with its trace, against one partition, and checks the best
layout's extrapolated cost against a whole partition of it. ``--exhaustive`` times the search that partitions every
layout whole, one after another, too (minutes). This machine's noise is several percent
between runs (more while anything else runs): compare ratios taken in one run, never absolute times across runs.
"""

from __future__ import annotations

import argparse
import time
import warnings


def _layout(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    pairs = [item.split("=") for item in text.split(",")]
    return tuple(int(size) for _, size in pairs), tuple(name for name, _ in pairs)


def _fastest(repeats: int, fn):
    """(seconds, result) of the fastest of ``repeats`` calls."""
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, result)
    return best


def main() -> None:
    import torch

    import partitioner
    from partitioner.frontend.trace import trace
    from partitioner.planning import planner
    from partitioner.testing import fake_mesh

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=37888)
    parser.add_argument("--layouts", nargs="*", default=["tp=8", "tp=8,ulysses=4"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--search", type=int, default=0, metavar="DEVICES")
    parser.add_argument("--exhaustive", action="store_true", help="also time the exhaustive search")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    model = planner.build_meta_model("minimax-h3")
    example = planner.example_inputs(model, args.rows)
    traced = trace(model, example)  # warm-up

    def export():
        with torch.no_grad():
            return torch.export.export(model, (), kwargs=example[1])

    export_s, _ = _fastest(args.repeats, export)
    trace_s, _ = _fastest(args.repeats, lambda: trace(model, example))
    print(f"full-size MiniMax-H3, {args.rows} rows, meta weights, fastest of {args.repeats}: torch.export alone "
          f"{export_s:.2f} s, trace alone {trace_s:.2f} s ({trace_s / export_s:.2f}x)")
    one_partition = None
    for layout in args.layouts:
        shape, names = _layout(layout)

        def partition():
            with fake_mesh(shape, names, 0) as mesh:
                return partitioner.partition(model, mesh, example)

        total, partitioned = _fastest(args.repeats, partition)
        one_partition = one_partition or total
        passes = dict(partitioned.ctx.pass_seconds)
        outside = total - trace_s - sum(passes.values())
        print(f"\n{layout}: partition {total:.2f} s = {total / export_s:.2f}x torch.export alone (target 1.5x)")
        print(f"  {'trace (as alone)':<24}{trace_s:7.2f} s")
        for name, seconds in sorted(passes.items(), key=lambda item: -item[1]):
            print(f"  {name:<24}{seconds:7.2f} s")
        print(f"  {'outside the passes':<24}{outside:7.2f} s")
    if args.search:
        import os

        start = time.perf_counter()
        found = planner.search(traced, "minimax-h3", args.search)
        searched = time.perf_counter() - start
        best = found[0]
        pruned = sum(e.pruned is not None for e in found)
        print(f"\nsearch over {len(found)} layouts of {args.search} devices ({pruned} pruned, the rest costed from "
              f"cuts of {best.extrapolated_from} blocks, {len(os.sched_getaffinity(0))} cores): {searched:.1f} s "
              f"from one trace = {searched / one_partition:.2f}x one partition ({args.layouts[0]}); with its trace "
              f"{searched + trace_s:.1f} s = {(searched + trace_s) / one_partition:.2f}x (target 3x)")
        whole = planner.estimate(traced, "minimax-h3", best.tp, best.ulysses, args.search, ring=best.ring)
        print(f"  best {best.layout}: step {best.step_s * 1e3:.3f} ms from the cuts, {whole.step_s * 1e3:.3f} ms "
              f"partitioned whole; memory {best.memory_bytes / 2**30:.3f} / {whole.memory_bytes / 2**30:.3f} GiB")
        if args.exhaustive:
            start = time.perf_counter()
            every = planner.search(traced, "minimax-h3", args.search, exhaustive=True, workers=1)
            exhaustive = time.perf_counter() - start
            print(f"  exhaustive search, one core: {exhaustive:.1f} s = {exhaustive / one_partition:.1f}x one "
                  f"partition; its best {every[0].layout} ({every[0].step_s * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
