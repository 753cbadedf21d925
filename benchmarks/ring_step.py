"""Ring attention against Ulysses on a mid-size MiniMax-H3, side by side in one run on this machine.

    python benchmarks/ring_step.py [--repeats 5]

Two ranks (gloo, one thread each) run the same mid-size H3 (8 heads x 64, 4 blocks, 2048 packed rows, float32)
partitioned as ring=2 and as ulysses=2, both checked exact against the single-device model on every rank, and
diffusers' own context parallelism on the same model (``enable_parallelism`` with ``ContextParallelConfig``, its
``_cp_plan`` hooks) where it runs on CPU: its Ulysses does; its ring needs an attention backend that returns the
log-sum-exp, which diffusers' native (CPU) backend does not, so that row prints diffusers' reason. Each row is the
median of --repeats forward passes after warm-up, the ranks synchronised by a barrier around every step. It prints
the times, our ring / Ulysses ratio (target: ring at most 1.25x Ulysses) and the bytes each of ours moves per step.
Timings on a shared 2-core machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tp_step import MID, ROWS, _inputs, _model, _time  # noqa: E402  (the same mid-size model and timing)

TARGET = 1.25


def _rank(rank: int, world: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    torch.set_num_threads(1)
    model, inputs = _model(MID), _inputs(MID, ROWS)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
    rows = {}
    for axis in ("ulysses", "ring"):
        partitioned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=(axis,)),
                                            ((), inputs))
        compiled = partitioned.compile()
        with torch.no_grad():
            error = (compiled(**inputs, return_dict=False)[0] - expected).abs().max().item()
        seconds = _time(lambda: compiled(**inputs, return_dict=False), repeats, dist.barrier)
        moved = sum(c.count * c.bytes_per_call for c in partitioned.report().collectives)
        rows[axis] = dict(seconds=seconds, error=error, moved=moved)
    rows.update(_diffusers(world, inputs, expected, repeats))
    return rows


def _diffusers(world: int, inputs: dict, expected: torch.Tensor, repeats: int) -> dict:
    """diffusers' context parallelism on the same model. Its mesh setup asks for an accelerator; on CPU gloo it
    runs once ``torch.accelerator.device_count`` says 1 (patched here, in the benchmark's own rank processes)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    torch.accelerator.device_count = lambda: 1
    rows = {}
    for name, config in (("diffusers ulysses", dict(ulysses_degree=world)),
                         ("diffusers ring", dict(ring_degree=world))):
        model = _model(MID)
        model.enable_parallelism(config=ContextParallelConfig(**config))
        step = lambda: model(**inputs, return_dict=False)  # noqa: E731
        try:
            with torch.no_grad():
                error = (step()[0] - expected).abs().max().item()
        except Exception as failure:  # diffusers' reason, printed in the row
            rows[name] = dict(failed=f"{type(failure).__name__}: {failure}")
            continue
        rows[name] = dict(seconds=_time(step, repeats, dist.barrier), error=error)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from partitioner.testing import run_ranks

    results = run_ranks(2, _rank, args.repeats)
    print(f"mid-size H3, {sum(ROWS.values())} packed rows, float32, 2 ranks x 1 thread")
    print(f"{'layout':<22} {'step ms':>9} {'max error':>10} {'bytes/step/rank':>16}")
    for name in results[0]:
        failed = [r[name]["failed"] for r in results if "failed" in r[name]]
        if failed:
            print(f"{name + '=2':<22} does not run here: {failed[0][:120]}")
            continue
        seconds = max(r[name]["seconds"] for r in results)
        error = max(r[name]["error"] for r in results)
        moved = f"{results[0][name]['moved']:>16,}" if "moved" in results[0][name] else f"{'-':>16}"
        print(f"{name + '=2':<22} {seconds * 1e3:>9.1f} {error:>10.1e} {moved}")
    ratio = max(r["ring"]["seconds"] for r in results) / max(r["ulysses"]["seconds"] for r in results)
    print(f"ring / ulysses: {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
