"""Ours against the hand-written peers, side by side: diffusers' context parallelism and cache-dit.

    python benchmarks/peers.py [--models flux wan ...] [--layouts ulysses tp ring] [--pairs 31]
                               [--backend eager|inductor] [--write]

Each zoo model a peer ships a plan for, widened to 8 heads x 48 (hidden 384) with 2-4 blocks, 512 latent rows and
64 text rows, float32, runs on 2 gloo ranks of one thread each at Ulysses=2, ring=2 and TP=2:
- ours: ``partition(model, mesh).compile(backend)``;
- diffusers: ``enable_parallelism(ContextParallelConfig(ulysses_degree | ring_degree))`` (its ``_cp_plan`` hooks;
  no tensor parallelism);
- cache-dit 1.5.3 (``enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size | ring_size | tp_size))``,
  its hand-written plans, no cache): installed on first use into ``benchmarks/.peers`` (never a dependency of
  the package).
The peers set up only with an accelerator: ``torch.accelerator.device_count`` (1) and ``current_accelerator``
(the CPU) are patched in the benchmark's rank processes only. cache-dit replaces diffusers' attention backends
process-wide, so each peer runs in its own pair of processes, against its own copy of ours.

Steps are interleaved pairs (ours, peer; the order alternates), the ranks synchronised by a barrier around each
step; the ratio of each pair is ours / peer, and the table shows the median ratio with its interquartile range
(25th-75th percentile), the median step times, bytes of parameters each rank holds, and each side's activation
peak (the most bytes the CPU allocator held during a call, weights and inputs not counted). Every side is checked
against the single-device model on both ranks; a peer that does not run prints its reason. Timings on a shared
2-core machine are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peers")
CACHE_DIT = ["cache-dit==1.5.3", "einops==0.8.2"]  # einops: its tensor-parallel plans need it
sys.path.insert(0, PEERS_DIR)

# 8 heads x 48 everywhere; blocks and rotary axes per model (the axes sum to the head dim). Sizes give 512 latent
# rows and 64 text rows as each pipeline lays them out.
_WIDE = dict(num_attention_heads=8, attention_head_dim=48)
MODELS = {
    "flux": (dict(_WIDE, num_layers=2, num_single_layers=2, axes_dims_rope=(16, 16, 16)),
             dict(text=64, height=32, width=64)),
    "flux2": (dict(_WIDE, num_layers=2, num_single_layers=2, axes_dims_rope=(12, 12, 12, 12)),
              dict(text=64, height=32, width=64)),
    "wan": (dict(_WIDE, num_layers=4, ffn_dim=1536, text_dim=384), dict(text=64, pad=8, frames=2, height=32, width=32)),
    "qwen_image": (dict(_WIDE, num_layers=4, axes_dims_rope=(16, 16, 16)), dict(text=64, height=32, width=64)),
    "ltx_video": (dict(_WIDE, num_layers=4, cross_attention_dim=384), dict(text=64, pad=8, frames=2, height=16,
                                                                            width=16)),
    "hunyuan_video": (dict(_WIDE, num_layers=2, num_single_layers=2, rope_axes_dim=(16, 16, 16)),
                      dict(text=64, pad=8, frames=2, height=32, width=32)),
    "cogvideox": (dict(_WIDE, num_layers=4, max_text_seq_length=64, sample_width=32, sample_height=32),
                  dict(text=64, frames=2, height=32, width=32)),
    "minimax_h3": (dict(_WIDE, hidden_size=384, num_layers=4, ffn_dim=1536, time_embed_hidden_dim=384),
                   dict(text=64, video=448, audio=64)),
}
LAYOUTS = ("ulysses", "ring", "tp")


def _install_cache_dit() -> None:
    """cache-dit into the benchmark's own folder (no dependencies: diffusers and torch are already here)."""
    try:
        import cache_dit  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", PEERS_DIR, *CACHE_DIT],
                       check=True)


def _config(name: str) -> tuple[type, dict, dict]:
    """The model's class, its widened config (the class defaults filled in) and the pipeline-built inputs at the
    benchmark's sizes."""
    import diffusers

    from partitioner.testing import zoo

    config = {**zoo.config(name), **MODELS[name][0]}
    _, inputs = zoo.ZOO[name].make_inputs(config, 0, **MODELS[name][1])
    return getattr(diffusers, zoo.ZOO[name].cls), config, inputs


@contextlib.contextmanager
def _cpu_as_accelerator():
    """The peers ask for an accelerator while they build their meshes; on this CPU build there is none. Only
    while they set up: torch.compile asks too, and must see none."""
    saved = torch.accelerator.device_count, torch.accelerator.current_accelerator
    torch.accelerator.device_count = lambda: 1
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    try:
        yield
    finally:
        torch.accelerator.device_count, torch.accelerator.current_accelerator = saved


def _peer(peer: str, layout: str, model: torch.nn.Module, world: int) -> None:
    """Set up ``peer``'s own parallelism on ``model`` (in place)."""
    if peer == "diffusers":
        from diffusers import ContextParallelConfig

        if layout == "tp":
            raise NotImplementedError("diffusers offers no tensor parallelism for this model")
        model.enable_parallelism(config=ContextParallelConfig(**{f"{layout}_degree": world}))
    else:
        import cache_dit

        cache_dit.enable_cache(model, parallelism_config=cache_dit.ParallelismConfig(**{f"{layout}_size": world}))


def _reason(failure: BaseException) -> str:
    """One line for the table: the message's first line (a rank's failure: its traceback's last line)."""
    lines = [line for line in str(failure).strip().splitlines() if line.strip()]
    if not lines:
        line = f"{type(failure).__name__} (no message)"
    elif type(failure).__name__ == "RankFailure":
        line = lines[-1]
    else:
        line = f"{type(failure).__name__}: {lines[0]}"
    return line[:200].replace("|", "\\|")


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (a DTensor's local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def _rank(rank: int, world: int, name: str, layout: str, peer: str, pairs: int, backend: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing import zoo
    from partitioner.testing.memory import peak_allocated_bytes

    torch.set_num_threads(1)
    cls, config, inputs = _config(name)
    model = zoo.seeded(lambda: cls(**config))
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
    partitioned = partitioner.partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=(layout,)),
                                        ((), inputs))
    ours = partitioned.compile(backend)
    report = partitioned.report()
    steps = {"ours": lambda: ours(**inputs, return_dict=False)}
    rows = {"ours": dict(held=sum(report.parameter_bytes.values()))}
    try:
        theirs = zoo.seeded(lambda: cls(**config))
        with _cpu_as_accelerator():
            _peer(peer, layout, theirs, world)
        if backend == "inductor":
            theirs = torch.compile(theirs)
        steps[peer] = lambda: theirs(**inputs, return_dict=False)
        rows[peer] = dict(held=_held_bytes(theirs))
    except Exception as failure:  # the peer's own reason, printed in its row
        rows[peer] = dict(failed=_reason(failure))
    ready = torch.tensor([peer in steps])
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # a set-up that failed on one rank is dropped on both
    if not ready.item() and peer in steps:
        del steps[peer]
        rows[peer] = dict(failed="its set-up failed on the other rank")
    for side, step in list(steps.items()):
        try:
            with torch.no_grad():
                rows[side]["error"] = (step()[0] - expected).abs().max().item() / expected.abs().max().item()
                step()
                rows[side]["peak"] = peak_allocated_bytes(step)
            dist.barrier()
        except Exception as failure:
            # A side that fails on one rank leaves the other waiting inside its collectives: return at once, so
            # this process's exit closes the connection and the other rank fails too (with a reason of its own).
            rows[side] = dict(failed=_reason(failure))
            return rows
    times = {side: [] for side in steps}
    with torch.no_grad():
        for pair in range(pairs):
            order = list(steps) if pair % 2 == 0 else list(reversed(steps))
            for side in order:
                dist.barrier()
                start = time.perf_counter()
                steps[side]()
                dist.barrier()
                times[side].append(time.perf_counter() - start)
    for side, seconds in times.items():
        rows[side]["times"] = seconds
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def run(models, layouts, pairs: int, backend: str) -> list[dict]:
    from partitioner.testing import run_ranks
    from partitioner.testing.ranks import RankFailure

    _install_cache_dit()
    table = []
    for name in models:
        for layout in layouts:
            for peer in ("diffusers", "cache-dit"):
                if peer == "diffusers" and layout == "tp":
                    table.append(dict(model=name, layout=layout, peer=peer, failed="no tensor parallelism offered"))
                    continue
                try:
                    ranks = run_ranks(2, _rank, name, layout, peer, pairs, backend)
                except RankFailure as failure:  # (its traceback is on stderr)
                    table.append(dict(model=name, layout=layout, peer=peer, failed=_reason(failure)))
                    print(_line(table[-1]), flush=True)
                    continue
                row = dict(model=name, layout=layout, peer=peer)
                for side in ("ours", peer):
                    failed = sorted((r[side]["failed"] for r in ranks if "failed" in r[side]),
                                    key=lambda reason: "Connection closed" in reason or "other rank" in reason)
                    if failed:
                        row[f"{side} failed"] = failed[0]
                        continue
                    if "times" not in ranks[0][side]:
                        continue  # the other side failed first
                    row[side] = dict(error=max(r[side]["error"] for r in ranks),
                                     held=max(r[side]["held"] for r in ranks),
                                     peak=max(r[side]["peak"] for r in ranks),
                                     times=[max(t) for t in zip(*(r[side]["times"] for r in ranks))])
                if "ours" in row and peer in row:
                    row["ratios"] = [a / b for a, b in zip(row["ours"]["times"], row[peer]["times"])]
                table.append(row)
                print(_line(row), flush=True)
    return table


def _line(row: dict) -> str:
    head = f"| {row['model']} | {row['layout']}=2 | {row['peer']} |"
    peer = row["peer"]
    if "failed" in row or f"{peer} failed" in row or "ours failed" in row:
        ours = row.get("ours")
        ours_ms = f"{statistics.median(ours['times']) * 1e3:.1f}" if ours else "-"
        reason = f"ours fails: {row['ours failed']}" if "ours failed" in row else \
            f"peer does not run: {row.get('failed') or row.get(f'{peer} failed')}"
        return f"{head} - | {ours_ms} | - | - | - | {reason} |"
    q1, median, q3 = statistics.quantiles(row["ratios"], n=4, method="inclusive")
    ours, theirs = row["ours"], row[peer]
    return (f"{head} {median:.3f} ({q1:.3f}-{q3:.3f}) | {statistics.median(ours['times']) * 1e3:.1f} | "
            f"{statistics.median(theirs['times']) * 1e3:.1f} | {_mib(ours['held'])} / {_mib(theirs['held'])} | "
            f"{_mib(ours['peak'])} / {_mib(theirs['peak'])} | {ours['error']:.1e} / {theirs['error']:.1e} |")


HEADER = ("| model | layout | peer | ours / peer step (IQR) | ours ms | peer ms | params MiB/rank ours / peer | "
          "activation peak MiB ours / peer | max error ours / peer |\n| --- | --- | --- | ---: | ---: | ---: | ---: | "
          "---: | ---: |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--pairs", type=int, default=31)
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    print(f"{args.backend}, 2 gloo ranks x 1 thread, {args.pairs} interleaved pairs, float32")
    print(HEADER)
    table = run(args.models, args.layouts, args.pairs, args.backend)
    if args.write:
        _write(table, args)


def _write(table: list[dict], args) -> None:
    """The backend's section of docs/benchmarks.md: rows of this run replace those of the same model, layout and
    peer (a run of some models updates theirs), in the order of MODELS."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")
    marker, end = f"<!-- peers {args.backend} -->", "<!-- end peers -->"
    text = open(path).read()
    start = text.find(marker)
    old = text[start:text.index(end, start)] if start >= 0 else ""
    key = lambda line: tuple(cell.strip() for cell in line.split("|")[1:4])  # noqa: E731
    rows = {key(line): line for line in old.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| model")}
    rows.update({key(_line(row)): _line(row) for row in table})
    place = {name: i for i, name in enumerate(MODELS)}
    ordered = sorted(rows.items(), key=lambda item: (place.get(item[0][0], len(place)),
                                                     LAYOUTS.index(item[0][1].split("=")[0]), item[0][2]))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    section = (f"{marker}\n{args.backend}, last run {datetime.date.today().isoformat()} ({machine}; `python "
               f"benchmarks/peers.py --backend {args.backend} --pairs {args.pairs}`):\n\n{HEADER}\n"
               + "\n".join(line for _, line in ordered) + "\n")
    text = text[:start] + section + text[text.index(end, start):] if start >= 0 else f"{text}\n{section}{end}\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
