"""Side-by-side step times of a mid-size MiniMax-H3 at TP=2 on this machine, measured in one run.

    python benchmarks/tp_step.py [--repeats 7] [--skip-compile-time]

Rows, each the median of --repeats forward passes after warm-up (one process per rank, one thread each, ranks
synchronised by a barrier around every step):
  single process, 1 thread / 2 threads           the unpartitioned model
  partitioner eager, TP=2, <variant>              our per-rank graph, op by op
  partitioner inductor, TP=2, <variant>           the same graph compiled by Inductor (regional)
    variants: overlap on (the default), without chunk_reductions, without schedule_collectives, without
    plan_tp_sequence, overlap off, the rules' choice as if communication hid fully behind compute (cpu-gloo with
    overlap 1: chunks and moves what a GPU profile would), and the rows between the tp regions sharded over tp
    whatever the cost rule says (communication costed free); a rank times its variants taking turns, step by step
  DTensor parallelize_module, TP=2                the module-hook approach with the equivalent hand-written plan
It prints ratios, the parallel efficiency (1-thread time / (workers x time), workers being ranks or threads),
bytes communicated per step, and
the cold compile time of a 50-block narrow H3, whole-graph against regional (Inductor's caches disabled, its
one-time set-up paid before timing).
Timings on a shared 2-core machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import tempfile
import time

import torch

MID = dict(num_attention_heads=8, attention_head_dim=64, hidden_size=512, num_layers=4, num_refiner_layers=1,
           ffn_dim=1536, in_channels=16, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=512, freq_dim=256,
           time_embed_hidden_dim=512, time_embed_dim=256, rope_freq_dim=8)
ROWS = dict(text=256, video=1728, audio=64)  # 2048 packed rows
NARROW = dict(MID, num_attention_heads=2, attention_head_dim=32, hidden_size=64, ffn_dim=128, text_dim=64,
              time_embed_hidden_dim=64, time_embed_dim=64, num_layers=50, rope_freq_dim=2)


def _model(config):
    from partitioner.testing import tiny_h3

    return tiny_h3(**config)


def _inputs(config, rows=ROWS):
    from partitioner.testing import h3_inputs

    return h3_inputs(config, **rows)


def _time(step, repeats: int, synchronise=lambda: None) -> float:
    with torch.no_grad():
        for _ in range(2):
            step()
        times = []
        for _ in range(repeats):
            synchronise()
            start = time.perf_counter()
            step()
            synchronise()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_process(rank: int, world: int, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    model, inputs = _model(MID), _inputs(MID)
    return _time(lambda: model(**inputs), repeats)


def _dtensor_plan(model, mesh, tp: int):
    """The hand-written module-hook plan: what diffusers' `_tp_plan` + parallelize_module amounts to for H3,
    including the two hand fixes the partitioner derives itself (head counts, packed SwiGLU halves)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    blocks = [f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
    blocks += [f"token_refiner.refiner_blocks.{i}" for i in range(len(model.token_refiner.refiner_blocks))]
    for block in blocks:
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "ff.net.0.proj"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attn.to_out.0", "ff.net.2"):
            plan[f"{block}.{name}"] = RowwiseParallel()
        module = model.get_submodule(block)
        module.attn.heads //= tp  # the reshape uses the configured head count: patch it by hand
        proj = module.ff.net[0].proj  # [value; gate] in one weight: interleave so each shard holds both halves
        value, gate = proj.weight.data.chunk(2)
        proj.weight.data = torch.cat([torch.cat([v, g]) for v, g in zip(value.chunk(tp), gate.chunk(tp))])
        if block.startswith("transformer_blocks"):
            plan[f"{block}.adaln_proj.linear"] = RowwiseParallel(input_layouts=Replicate())
    return parallelize_module(model, mesh, plan)


def _as_if_hidden():
    """cpu-gloo with its overlap share set to 1: what the rules would do if gloo's all_reduces ran beside the
    compute (on this CPU they share its cores; the measured share is about 0.1)."""
    import dataclasses

    from partitioner.planning.cost import load_profile

    return dataclasses.replace(load_profile("cpu-gloo"), name="cpu-gloo, overlap 1", overlap=1.0)


def _free_links():
    """cpu-gloo with communication that costs nothing: plan_tp_sequence always shards the rows between the tp
    regions (and chunk_reductions, with nothing to hide, chunks nothing)."""
    import dataclasses

    from partitioner.planning.cost import load_profile

    return dataclasses.replace(load_profile("cpu-gloo"), name="cpu-gloo, free links", local_gbps=1e9, link_gbps=1e9,
                               latency_us=0.0, overlap=0.0)


OVERLAP = {"overlap on": True, "no chunk_reductions": {"chunk_reductions": False},
           "no schedule": {"schedule": False}, "no tp_sequence": {"tp_sequence": False}, "overlap off": False,
           "as if comm hid fully": "as-if-hidden", "rows sharded over tp (forced)": "free-links"}


def _interleaved(steps: dict, repeats: int, synchronise) -> dict:
    """Median seconds of each step, the steps taking turns (drift in the machine's load hits them alike)."""
    times = {name: [] for name in steps}
    with torch.no_grad():
        for step in steps.values():
            step(), step()
        for _ in range(repeats):
            for name, step in steps.items():
                synchronise()
                start = time.perf_counter()
                step()
                synchronise()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def tensor_parallel(rank: int, world: int, mode: str, repeats: int) -> dict:
    """``mode``: "dtensor", or a partitioner backend timed with every overlap variant (``OVERLAP``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, inputs = _model(MID), _inputs(MID)
    with torch.no_grad():
        expected = model(**inputs).sample
    from partitioner.planning.dump import graph_code

    steps, errors, sent, programs = {}, {}, {}, {}
    if mode == "dtensor":
        model = _dtensor_plan(model, mesh, world)
        steps["dtensor"] = lambda: model(**inputs)  # noqa: E731
    else:
        for name, overlap in OVERLAP.items():
            profile = {"as-if-hidden": _as_if_hidden, "free-links": _free_links}.get(overlap) \
                if isinstance(overlap, str) else None
            overlap = {"profile": profile()} if profile else overlap
            partitioned = partitioner.partition(model, mesh, ((), inputs), overlap=overlap)
            steps[name] = functools.partial(partitioned.compile(mode), **inputs)
            sent[name] = sum(c.count * c.bytes_per_call for c in partitioned.report().collectives)
            programs[name] = hashlib.sha256(graph_code(partitioned.graph_module).encode()).hexdigest()[:8]
    with torch.no_grad():
        for name, step in steps.items():
            errors[name] = float((step().sample - expected).abs().max())
    seconds = _interleaved(steps, repeats, dist.barrier)
    return {name: dict(seconds=seconds[name], error=errors[name], bytes=sent.get(name), program=programs.get(name))
            for name in steps}


def compile_time(rank: int, world: int, regional: bool) -> dict:
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    inductor_config.fx_graph_cache = False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    inputs = _inputs(NARROW, dict(text=16, video=96, audio=16))
    partitioned = partitioner.partition(_model(NARROW), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                                        ((), inputs))
    # Inductor's one-time set-up (imports, toolchain checks) is paid by a throwaway compilation first
    from torch._inductor.compile_fx import compile_fx

    warm = torch.fx.symbolic_trace(lambda x: (x.sin() + 1,))
    compile_fx(warm, [torch.randn(4)])(torch.randn(4))
    compiled = partitioned.compile("inductor", regional=regional)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(**inputs)
    return dict(seconds=time.perf_counter() - start, **vars(compiled.stats))


def main() -> None:
    from partitioner.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-compile-time", action="store_true")
    args = parser.parse_args()

    rows = {"single process, 1 thread": run_ranks(1, single_process, 1, args.repeats)[0],
            "single process, 2 threads": run_ranks(1, single_process, 2, args.repeats)[0]}
    details = {}
    for mode in ("eager", "inductor", "dtensor"):
        ranks = run_ranks(2, tensor_parallel, mode, args.repeats)
        for name in ranks[0]:
            label = "DTensor parallelize_module, TP=2" if mode == "dtensor" else f"partitioner {mode}, TP=2, {name}"
            rows[label] = max(r[name]["seconds"] for r in ranks)
            details[label] = ranks[0][name]
    one_thread = rows["single process, 1 thread"]
    print(f"MiniMax-H3 mid config: {MID['num_attention_heads']} heads x {MID['attention_head_dim']}, hidden "
          f"{MID['hidden_size']}, {MID['num_layers']} blocks, {sum(ROWS.values())} packed rows, float32, "
          f"median of {args.repeats}")
    print(f"{'':46} {'ms/step':>9} {'vs 1 thread':>12} {'efficiency':>11} {'max |err|':>10} {'program':>9}")
    for label, seconds in rows.items():
        workers = 2 if "TP=2" in label or "2 threads" in label else 1
        error, program = details.get(label, {}).get("error"), details.get(label, {}).get("program")
        print(f"{label:46} {seconds * 1e3:9.1f} {one_thread / seconds:11.2f}x {one_thread / (workers * seconds):11.2f} "
              f"{'' if error is None else f'{error:10.1e}'} {program or '':>9}")
    print("(program: a hash of rank 0's graph; rows with the same hash run the same program, so their difference "
          "is this machine's noise)")
    dtensor = rows["DTensor parallelize_module, TP=2"]
    for mode in ("eager", "inductor"):
        on, off = rows[f"partitioner {mode}, TP=2, overlap on"], rows[f"partitioner {mode}, TP=2, overlap off"]
        print(f"{mode}: overlap on / off {on / off:.3f}, on / DTensor {on / dtensor:.3f}")
    print(f"bytes communicated per step per rank: "
          f"{details['partitioner eager, TP=2, overlap on']['bytes'] / 2**20:.2f} MiB")
    if not args.skip_compile_time:
        whole = run_ranks(1, compile_time, False)[0]
        regional = run_ranks(1, compile_time, True)[0]
        print(f"cold compile, {NARROW['num_layers']}-block narrow H3: whole graph {whole['seconds']:.1f} s, regional "
              f"{regional['seconds']:.1f} s ({regional['compilations']} compilations for {regional['regions']} "
              f"regions): {whole['seconds'] / regional['seconds']:.1f}x faster")


if __name__ == "__main__":
    main()
