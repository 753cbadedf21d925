"""Time to first step, and what compiling costs once partitioned, on a mid-size 50-block MiniMax-H3.

    python benchmarks/first_step.py [--blocks 50] [--skip-4-ranks]

The model (8 heads x 64, hidden 512, ``--blocks`` blocks, float32, random weights) is saved once with
``save_pretrained`` to a temporary folder. Then, each in fresh processes with its own empty Inductor cache folder
(``TORCHINDUCTOR_CACHE_DIR``; a cold start), one thread and one compile worker per process:
  unpartitioned   the model loaded from the folder, every repeated block compiled on its own (``block.compile()``,
                  PyTorch's regional compilation recipe), first call;
  TP=2, TP=2 x Ulysses=2
                  the model built on the meta device, ``partition``, ``load_weights`` (shard-on-read from the
                  folder), ``compile("inductor")`` (regional), first call: the drop-in module's one-line time to
                  first step, per rank;
  TP=2 again      a second start on the first TP=2 run's cache folder: what Inductor's FX graph cache saves.
Compile cost is the first call's CPU seconds (the process and the compiler subprocesses it waits for), which
ranks sharing 2 cores do not inflate the way wall time is; both are printed. Issue 36's target: the partitioned
compile no more than 1.2x the unpartitioned one, and a second start compiling nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tp_step import MID  # noqa: E402  (the same mid-size width)

ROWS = dict(text=64, video=448, audio=64)  # 576 packed rows: compile time does not grow with rows


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _settle(cache_dir: str) -> None:
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor_config.compile_threads = 1
    torch.set_num_threads(1)


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


def unpartitioned(rank: int, world: int, folder: str, cache_dir: str) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel

    from partitioner.testing import h3_inputs

    _settle(cache_dir)
    model = MiniMaxH3Transformer3DModel.from_pretrained(folder).eval()
    for module in model.modules():  # every child of a ModuleList of repeated blocks, compiled on its own
        if isinstance(module, torch.nn.ModuleList) and len({type(child) for child in module}) == 1 and len(module) > 1:
            for child in module:
                child.compile()
    inputs = h3_inputs(dict(model.config), **ROWS)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    with torch.no_grad():
        model(**inputs)
    return dict(wall=time.perf_counter() - wall, cpu=_cpu_seconds() - cpu, cache=_counters())


def partitioned(rank: int, world: int, folder: str, cache_dir: str, layout: tuple) -> dict:
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing import h3_inputs

    _settle(cache_dir)
    config = MiniMaxH3Transformer3DModel.load_config(folder)
    with init_empty_weights():
        model = MiniMaxH3Transformer3DModel.from_config(config)
    inputs = h3_inputs(dict(model.config), **ROWS)
    mesh = init_device_mesh("cpu", tuple(size for _, size in layout), mesh_dim_names=tuple(n for n, _ in layout))
    module = partitioner.partition(model, mesh, ((), inputs)).load_weights(folder).compile("inductor")
    wall, cpu = time.perf_counter(), _cpu_seconds()
    with torch.no_grad():
        module(**inputs)
    return dict(wall=time.perf_counter() - wall, cpu=_cpu_seconds() - cpu, cache=_counters(),
                line=module.first_step, compilations=module.stats.compilations, regions=module.stats.regions)


def main() -> None:
    from partitioner.testing import run_ranks, tiny_h3

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--skip-4-ranks", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "model")
        tiny_h3(**dict(MID, num_layers=args.blocks)).save_pretrained(folder)
        runs = {"unpartitioned (regional)": (1, unpartitioned, ())}
        runs["TP=2"] = (2, partitioned, ((("tp", 2),),))
        runs["TP=2, second start"] = (2, partitioned, ((("tp", 2),),))
        if not args.skip_4_ranks:
            runs["TP=2 x Ulysses=2"] = (4, partitioned, ((("tp", 2), ("ulysses", 2)),))
        results = {}
        for name, (world, fn, extra) in runs.items():
            cache_dir = os.path.join(root, "cache-tp2" if name.startswith("TP=2") and "Ulysses" not in name
                                     else f"cache-{len(results)}")
            results[name] = run_ranks(world, fn, folder, cache_dir, *extra)
    print(f"mid-size MiniMax-H3, {args.blocks} blocks ({MID['num_attention_heads']} heads x "
          f"{MID['attention_head_dim']}, hidden {MID['hidden_size']}), {sum(ROWS.values())} rows, float32; "
          f"first call, one thread per process")
    base = results["unpartitioned (regional)"][0]["cpu"]
    print(f"{'':28} {'rank':>4} {'CPU s':>7} {'wall s':>7} {'vs unpartitioned':>17}  FX graph cache")
    for name, ranks in results.items():
        for rank, result in enumerate(ranks):
            cache = ", ".join(f"{k.removeprefix('fxgraph_cache_')} {v}" for k, v in sorted(result["cache"].items()))
            print(f"{name if rank == 0 else '':28} {rank:>4} {result['cpu']:7.1f} {result['wall']:7.1f} "
                  f"{result['cpu'] / base:16.2f}x  {cache}")
    for name, ranks in results.items():
        if "line" in ranks[0]:
            print(f"{name}, rank 0: {ranks[0]['line']} ({ranks[0]['compilations']} Inductor compilations for "
                  f"{ranks[0]['regions']} regions)")


if __name__ == "__main__":
    main()
