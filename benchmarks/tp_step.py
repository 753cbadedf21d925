"""Side-by-side step times of a mid-size MiniMax-H3 at TP=2 on this machine, measured in one run.

    python benchmarks/tp_step.py [--repeats 7] [--skip-compile-time]

Rows, each the median of --repeats forward passes after warm-up (one process per rank, one thread each, ranks
synchronised by a barrier around every step):
  single process, 1 thread / 2 threads           the unpartitioned model
  partitioner eager, TP=2                         our per-rank graph, op by op
  partitioner inductor, TP=2                      the same graph compiled by Inductor (regional)
  DTensor parallelize_module, TP=2                the module-hook approach with the equivalent hand-written plan
It prints ratios, the parallel efficiency (1-thread time / (workers x time), workers being ranks or threads),
bytes communicated per step, and
the cold compile time of a 50-block narrow H3, whole-graph against regional (Inductor's caches disabled, its
one-time set-up paid before timing).
Timings on a shared 2-core machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
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


def tensor_parallel(rank: int, world: int, mode: str, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, inputs = _model(MID), _inputs(MID)
    with torch.no_grad():
        expected = model(**inputs).sample
    result = {}
    if mode == "dtensor":
        model = _dtensor_plan(model, mesh, world)
        step = lambda: model(**inputs)  # noqa: E731
    else:
        partitioned = partitioner.partition(model, mesh, ((), inputs))
        compiled = partitioned.compile(mode)
        step = lambda: compiled(**inputs)  # noqa: E731
        result["bytes"] = sum(c.count * c.bytes_per_call for c in partitioned.report().collectives)
    with torch.no_grad():
        result["error"] = float((step().sample - expected).abs().max())
    result["seconds"] = _time(step, repeats, dist.barrier)
    return result


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
    for label, mode in (("partitioner eager, TP=2", "eager"), ("partitioner inductor, TP=2", "inductor"),
                        ("DTensor parallelize_module, TP=2", "dtensor")):
        ranks = run_ranks(2, tensor_parallel, mode, args.repeats)
        rows[label] = max(r["seconds"] for r in ranks)
        details[label] = ranks[0]
    one_thread = rows["single process, 1 thread"]
    print(f"MiniMax-H3 mid config: {MID['num_attention_heads']} heads x {MID['attention_head_dim']}, hidden "
          f"{MID['hidden_size']}, {MID['num_layers']} blocks, {sum(ROWS.values())} packed rows, float32, "
          f"median of {args.repeats}")
    print(f"{'':34} {'ms/step':>9} {'vs 1 thread':>12} {'efficiency':>11} {'max |err|':>10}")
    for label, seconds in rows.items():
        workers = 2 if "TP=2" in label or "2 threads" in label else 1
        error = details.get(label, {}).get("error")
        print(f"{label:34} {seconds * 1e3:9.1f} {one_thread / seconds:11.2f}x {one_thread / (workers * seconds):11.2f} "
              f"{'' if error is None else f'{error:10.1e}'}")
    eager, inductor = rows["partitioner eager, TP=2"], rows["partitioner inductor, TP=2"]
    dtensor = rows["DTensor parallelize_module, TP=2"]
    print(f"eager / DTensor {eager / dtensor:.2f}, inductor / eager {inductor / eager:.2f}; "
          f"bytes communicated per step per rank: {details['partitioner eager, TP=2']['bytes'] / 2**20:.2f} MiB")
    if not args.skip_compile_time:
        whole = run_ranks(1, compile_time, False)[0]
        regional = run_ranks(1, compile_time, True)[0]
        print(f"cold compile, {NARROW['num_layers']}-block narrow H3: whole graph {whole['seconds']:.1f} s, regional "
              f"{regional['seconds']:.1f} s ({regional['compilations']} compilations for {regional['regions']} "
              f"regions): {whole['seconds'] / regional['seconds']:.1f}x faster")


if __name__ == "__main__":
    main()
