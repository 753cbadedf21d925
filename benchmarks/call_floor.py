"""The fixed cost of a partitioned call, broken down: what a denoising step pays besides the model's own compute.

    python benchmarks/call_floor.py [--tp 2] [--ulysses 2] [--calls 40] [--profile]

The tiny Flux pipeline of ``make demo`` (``partitioner.testing.pipelines.tiny_flux_pipeline``: 2 + 2 blocks, 4
heads) is parallelised on ``tp x ulysses`` local gloo ranks; one denoiser call, as the pipeline makes it, is
recorded and then repeated ``--calls`` times on every rank (a barrier before each, so that the ranks start together
and the agreement's time is its own, not a straggler's). Each phase of the drop-in's call is timed by wrapping it
in this process only (the package is not changed):

  prepare      binding the arguments, choosing the program, every input check and the host prologue
  digest       the input values' fingerprint the ranks compare
  agreement    the one all_reduce that tells every rank the call is agreed: issuing it, and waiting for it (the
               program waits just before its first collective, after the compute ahead of it)
  program      the rank program itself (compute and the planned collectives), less that wait
  rest         the remainder of the call (outputs rebuilt into the model's output class)

Then the same call side by side in interleaved pairs, the agreement overlapped (as shipped) and waited for before
the program starts (as before the overlap): the medians of both and of the per-pair ratio.

``--profile`` also splits the program on rank 0 with torch.profiler: time inside collectives (issue and wait),
inside other ops, and the remainder (the program's Python: the generated GraphModule code between ops).
Printed: medians (and min-max) in milliseconds per call, rank by rank, with the unpartitioned model's call on the
same inputs for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import partitioner  # noqa: E402
from partitioner.runtime import agreement, module, program  # noqa: E402
from partitioner.testing import launch  # noqa: E402

PHASES = ("prepare", "digest", "agreement", "program", "rest", "call")


def _timed(owner, name: str, phase: str, spent: dict):
    """Replace ``owner.name`` by a wrapper adding its seconds to ``spent[phase]``; returns the original."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return original


def _record_call(pipe, height: int, width: int):
    """One denoiser call's (args, kwargs) as the pipeline makes it (its second step)."""
    calls = []
    forward = pipe.transformer.forward

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return forward(*args, **kwargs)

    pipe.transformer.forward = recording
    pipe(prompt="a photo of a cat", height=height, width=width, num_inference_steps=3, max_sequence_length=12,
         guidance_scale=3.5, output_type="pt", generator=torch.Generator().manual_seed(0))
    pipe.transformer.forward = forward
    return calls[-1]


def _overlap_pairs(program, call, pairs: int) -> list[tuple[float, float]]:
    """(overlapped, waited first) seconds of ``pairs`` interleaved calls: the program that settles the agreement
    before its first collective, then the same program told it cannot (so the call waits before running it)."""
    programs = [program] if getattr(program.lowered, "settles_agreement", False) else []
    timings = []
    with torch.no_grad():
        for _ in range(pairs):
            pair = []
            for overlapped in (True, False):
                for program in programs:
                    program.lowered.settles_agreement = overlapped
                dist.barrier()
                start = time.perf_counter()
                call()
                pair.append(time.perf_counter() - start)
            timings.append(tuple(pair))
    for program in programs:
        program.lowered.settles_agreement = True
    return timings


def _profile(call, repeats: int) -> dict[str, float]:
    """Seconds per call inside collectives, inside other ops, and between ops (of the program, on this rank)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            with record_function("partitioned call"):
                call()
    events = prof.events()
    total = sum(e.cpu_time_total for e in events if e.name == "partitioned call")
    top = [e for e in events if e.cpu_parent is not None and e.cpu_parent.name == "partitioned call"]
    collective = sum(e.cpu_time_total for e in top if "c10d" in e.name or "wait_tensor" in e.name)
    ops = sum(e.cpu_time_total for e in top) - collective
    return {"collectives": collective / repeats / 1e6, "other ops": ops / repeats / 1e6,
            "between ops": (total - collective - ops) / repeats / 1e6}


def run_rank(rank: int, world: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.testing.pipelines import tiny_flux_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.tp, args.ulysses), mesh_dim_names=("tp", "ulysses"))
    reference = tiny_flux_pipeline().transformer
    pipe = partitioner.parallelize(tiny_flux_pipeline(), mesh)
    call_args, call_kwargs = _record_call(pipe, args.height, args.width)
    drop_in = pipe.transformer

    spent = defaultdict(float)
    originals = {"prepare": _timed(module.PartitionedModule, "_prepare", "prepare", spent),
                 "digest": _timed(agreement, "values_digest", "digest", spent),
                 "all_reduce": _timed(agreement.dist, "all_reduce", "agreement", spent),
                 "settle": _timed(agreement.PendingAgreement, "_settle", "settle", spent),
                 "run": _timed(program.CompiledPartition, "run", "program", spent)}
    per_call = defaultdict(list)
    try:
        for _ in range(args.calls):
            dist.barrier()
            spent.clear()
            start = time.perf_counter()
            with torch.no_grad():
                drop_in(*call_args, **call_kwargs)
            spent["call"] = time.perf_counter() - start
            spent["program"] -= spent["settle"]  # (the wait happens inside the program)
            spent["agreement"] += spent["settle"]
            spent["rest"] = spent["call"] - sum(spent[p] for p in ("prepare", "digest", "agreement", "program"))
            for phase in PHASES:
                per_call[phase].append(spent[phase])
    finally:
        module.PartitionedModule._prepare = originals["prepare"]
        agreement.values_digest = originals["digest"]
        agreement.dist.all_reduce = originals["all_reduce"]
        agreement.PendingAgreement._settle = originals["settle"]
        program.CompiledPartition.run = originals["run"]
    unpartitioned = []
    with torch.no_grad():
        for _ in range(args.calls):
            start = time.perf_counter()
            reference(*call_args, **call_kwargs)
            unpartitioned.append(time.perf_counter() - start)
    result = {phase: times for phase, times in per_call.items()}
    result["unpartitioned"] = unpartitioned
    result["pairs"] = _overlap_pairs(drop_in._module.program, lambda: drop_in(*call_args, **call_kwargs), args.calls)
    if args.profile:
        dist.barrier()
        with torch.no_grad():
            result["profile"] = _profile(lambda: drop_in(*call_args, **call_kwargs), args.calls)
    return result


def _cell(times: list[float]) -> str:
    return f"{1e3 * statistics.median(times):6.2f} ({1e3 * min(times):.2f}-{1e3 * max(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--height", type=int, default=12)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="split the program on every rank (torch.profiler)")
    args = parser.parse_args()
    results = launch(args.tp * args.ulysses, run_rank, args)
    if results is None:
        return
    print(f"tiny Flux denoiser call, TP={args.tp} x Ulysses={args.ulysses} on gloo, {args.calls} calls; "
          f"ms per call, median (min-max), torch {torch.__version__}")
    print("rank | " + " | ".join(f"{p:>20}" for p in (*PHASES, "unpartitioned")))
    for rank, result in enumerate(results):
        print(f"{rank:>4} | " + " | ".join(f"{_cell(result[p]):>20}" for p in (*PHASES, "unpartitioned")))
    for rank, result in enumerate(results):
        overlapped, waited = zip(*result["pairs"])
        ratio = [a / b for a, b in result["pairs"]]
        print(f"rank {rank}: agreement overlapped {_cell(list(overlapped))} vs waited first {_cell(list(waited))} ms; "
              f"per-pair ratio median {statistics.median(ratio):.3f} ({min(ratio):.2f}-{max(ratio):.2f})")
    if args.profile:
        for rank, result in enumerate(results):
            print(f"rank {rank} program, per call: " + ", ".join(f"{k} {1e3 * v:.2f} ms"
                                                                 for k, v in result["profile"].items()))


if __name__ == "__main__":
    main()
