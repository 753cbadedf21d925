"""Per-rank memory under sequence parallelism: the report's activation estimate against the measured peak.

    python benchmarks/sequence_memory.py [--layouts ulysses=2 ring=2 ulysses=4 ring=2,ulysses=2]

The mid-size MiniMax-H3 of ``tp_step.py`` (8 heads x 64, hidden 512, 4 blocks, 2048 packed rows, float32) runs on
one device and partitioned over each layout (gloo ranks, one thread each), exact against the single-device model
on every rank. For each it prints the report's per-rank activation estimate (``Report.activation_peak_bytes``) and
the measured per-rank peak: the most bytes the CPU allocator held during one forward pass
(``partitioner.testing.peak_allocated_bytes``, the least of three passes; weights and inputs were allocated
before and are not counted),
both as a share of the single-device value (the traced graph run on one device: eager Python would keep a
forward's locals alive longer). Each rank builds only its rows of the packed sequence
(``gather_scatters``), so both fall roughly with the sequence degree; what stays is whole on every rank (the text
refiner's rows, per-row index tables, the gathered output heads).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tp_step import MID, ROWS, _inputs, _model  # noqa: E402  (the same mid-size model)


def _parse(layout: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    axes = [part.split("=") for part in layout.split(",")]
    return tuple(int(size) for _, size in axes), tuple(name for name, _ in axes)


def _measure(rank: int, world: int, layouts: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing import peak_allocated_bytes

    torch.set_num_threads(1)
    model, inputs = _model(MID), _inputs(MID, ROWS)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
        results = {}
        for layout in layouts:
            shape, names = _parse(layout)
            partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names),
                                                ((), inputs))
            compiled = partitioned.compile()
            error = (compiled(**inputs, return_dict=False)[0] - expected).abs().max().item()
            # the least of three: a collective's buffers freed late (another thread's timing) only ever add
            measured = min(peak_allocated_bytes(lambda: compiled(**inputs, return_dict=False)) for _ in range(3))
            results[layout] = dict(error=error, estimate=partitioned.report().activation_peak_bytes,
                                   measured=measured)
    return results


def _single_device() -> dict:
    from partitioner.api import partition
    from partitioner.testing import traced_peak_bytes

    torch.set_num_threads(1)
    model, inputs = _model(MID), _inputs(MID, ROWS)
    measured = traced_peak_bytes(model, inputs)  # the single-device graph, as the partitions run theirs
    estimate = partition(model, {"tp": 1}, ((), inputs)).report().activation_peak_bytes
    return dict(error=0.0, estimate=estimate, measured=measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["ulysses=2", "ring=2", "ulysses=4", "ring=2,ulysses=2"])
    args = parser.parse_args()
    from partitioner.testing import run_ranks

    rows = {"single device": _single_device()}
    by_world: dict[int, list[str]] = {}
    for layout in args.layouts:
        by_world.setdefault(math.prod(_parse(layout)[0]), []).append(layout)
    for world, layouts in by_world.items():
        results = run_ranks(world, _measure, layouts)
        for layout in layouts:  # the rank with the largest measured peak: what must fit
            largest = max(results, key=lambda r: r[layout]["measured"])
            rows[layout] = dict(largest[layout], error=max(r[layout]["error"] for r in results))
            if rows[layout]["error"] > 1e-5:
                raise SystemExit(f"{layout}: a rank differs from the single device by {rows[layout]['error']:.1e}")
    single = rows["single device"]
    print(f"mid-size H3, {sum(ROWS.values())} packed rows, float32; per-rank activation bytes (largest rank)")
    print(f"{'layout':<18} {'estimate MiB':>13} {'share':>6} {'measured MiB':>13} {'share':>6} {'max error':>10}")
    for layout, row in rows.items():
        print(f"{layout:<18} {row['estimate'] / 2**20:>13.1f} {row['estimate'] / single['estimate']:>6.2f} "
              f"{row['measured'] / 2**20:>13.1f} {row['measured'] / single['measured']:>6.2f} {row['error']:>10.1e}")


if __name__ == "__main__":
    main()
