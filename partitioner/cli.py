"""``python -m partitioner report``: plan a deployment on meta weights; ``calibrate``: measure this machine.

    python -m partitioner report --model minimax-h3 --mesh tp=8,ring=2,ulysses=4 --seq-len 37888 \\
        --dtype bfloat16 --device-memory 24GiB [--json] [--html plan.html] [--profile trn2]
    python -m partitioner report --model minimax-h3 --search --devices 64 --device-memory 24GiB --seq-len 37888
    python -m partitioner report --config path/to/config.json --mesh tp=8 --seq-len 8192
    python -m partitioner calibrate --out cpu.json [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .frontend.trace import trace
from .mesh import MeshError
from .planning import cost, planner


def _mesh(text: str) -> dict[str, int]:
    try:
        pairs = [item.split("=") for item in text.split(",") if item]
        return {name.strip(): int(size) for name, size in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes axis=size pairs such as tp=8,ulysses=4, got {text!r}")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _table(estimates: list[planner.LayoutEstimate]) -> str:
    lines = [f"{'tp':>3} {'ring':>4} {'ulysses':>7} {'replicas':>8} {'params':>11} {'activations':>11} {'total':>11} "
             f"{'fits':>5} {'comm/step':>11} {'compute ms':>10} {'comm ms':>8} {'exposed':>8} {'step ms':>8} "
             f"{'req/s':>6}"]
    for e in estimates:
        if e.error or e.pruned:
            why = f"impossible: {e.error}" if e.error else f"pruned: {e.pruned}"
            lines.append(f"{e.tp:>3} {e.ring:>4} {e.ulysses:>7} {e.replicas:>8}  {why}")
            continue
        fits = {None: "-", True: "yes", False: "no"}[e.fits]
        lines.append(f"{e.tp:>3} {e.ring:>4} {e.ulysses:>7} {e.replicas:>8} {_gib(sum(e.parameter_bytes.values())):>11} "
                     f"{_gib(e.activation_bytes):>11} {_gib(e.memory_bytes):>11} {fits:>5} "
                     f"{_gib(sum(e.collective_bytes.values())):>11} {e.compute_s * 1e3:>10.1f} "
                     f"{e.comm_s * 1e3:>8.1f} {e.exposed_comm_s * 1e3:>8.1f} {e.step_s * 1e3:>8.1f} "
                     f"{e.requests_per_s:>6.2f}")
    blocks = {e.extrapolated_from for e in estimates if e.extrapolated_from}
    if blocks:
        lines.append(f"(costed from the trace cut to 2 and 3 of its {max(blocks)} repeated blocks, exact for identical "
                     "blocks; --exhaustive partitions every layout whole)")
    return "\n".join(lines)


def _detail(e: planner.LayoutEstimate) -> str:
    lines = [f"layout {e.layout} (rank 0) on {e.profile}"]
    lines += [f"  parameters {dtype:<10} {_gib(size)}" for dtype, size in sorted(e.parameter_bytes.items())]
    lines += [f"  {which} rank {r['rank']}: {r['parameter_count']:,} parameters, {_gib(r['bytes'])}"
              for which, r in e.parameter_ranks.items()]
    lines.append(f"  activation peak (estimate) {_gib(e.activation_bytes)}")
    lines += [f"  {kind:<12} {_gib(size)} per step" for kind, size in sorted(e.collective_bytes.items())]
    lines.append(f"  step estimate {e.step_s * 1e3:.1f} ms (compute {e.compute_s * 1e3:.1f}, communication "
                 f"{e.comm_s * 1e3:.1f} of which exposed {e.exposed_comm_s * 1e3:.1f}; "
                 + ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in sorted(e.comm_s_by_kind.items())) + ")")
    if e.fits is not None:
        lines.append(f"  needs {_gib(e.memory_bytes)} of {_gib(e.device_memory)}: {'fits' if e.fits else 'does NOT fit'}")
    return "\n".join(lines)


def report(args) -> int:
    mesh = args.mesh or {"tp": 1}
    unknown = set(mesh) - {"tp", "ring", "ulysses"}
    if unknown:
        raise MeshError(f"unknown mesh dim names {sorted(unknown)}: use tp, ring and ulysses")
    dtype = getattr(torch, args.dtype)
    profile = cost.with_overrides(cost.load_profile(args.profile), matmul_tflops=args.tflops,
                                  link_gbps=args.link_gbps)
    memory = planner.parse_bytes(args.device_memory) if args.device_memory else profile.memory_bytes
    model = planner.build_meta_model(args.config or args.model, dtype)
    traced = trace(model, planner.example_inputs(model, args.seq_len, dtype))
    name = type(model).__name__
    if args.search:
        estimates = planner.search(traced, name, args.devices, profile, memory, ring=not args.no_ring,
                                   exhaustive=args.exhaustive)
    else:
        estimates = [planner.estimate(traced, name, mesh.get("tp", 1), mesh.get("ulysses", 1), profile=profile,
                                      device_memory=memory, ring=mesh.get("ring", 1))]
    if args.json:
        print(json.dumps([e.as_dict() for e in estimates], indent=2))
    elif args.search:
        print(_table(estimates))
    else:
        print(_detail(estimates[0]) if not estimates[0].error else f"impossible: {estimates[0].error}")
    if args.html:  # the chosen (or best) layout as a picture
        _write_html(args.html, traced, name, estimates[0])
    return 0


def _write_html(path: str, traced, name: str, best: planner.LayoutEstimate) -> None:
    from .planning.plan_view import write_html

    if best.error:
        print(f"not writing {path}: layout {best.layout} is impossible", file=sys.stderr)
        return
    partitioned = planner.partition_layout(traced, name, best.tp, best.ulysses, best.ring)
    write_html(partitioned, path, {"compute_s": best.compute_s, "comm_s": best.comm_s,
                                   "exposed_comm_s": best.exposed_comm_s})
    print(f"wrote {path} ({best.layout})", file=sys.stderr)


def calibrate(args) -> int:
    from .planning.calibrate import calibrate as calibrate_this_host

    profile = calibrate_this_host(args.threads)
    Path(args.out).write_text(profile.to_json())
    print(f"wrote {args.out}: {profile.matmul_tflops * 1e3:.1f} GFLOP/s matmul, {profile.memory_gbps:.1f} GB/s "
          f"memory, {profile.local_gbps:.2f} GB/s and {profile.latency_us:.0f} us per message between ranks")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partitioner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser("report", help="per-rank memory, communication and step estimate of a layout")
    source = rep.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(planner.MODELS))
    source.add_argument("--config", help="a diffusers config.json, or the folder holding it")
    rep.add_argument("--mesh", type=_mesh, help="axis sizes, e.g. tp=8,ring=2,ulysses=4")
    rep.add_argument("--seq-len", type=int, required=True, help="packed sequence rows of one request")
    rep.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    rep.add_argument("--device-memory", help="memory of one device, e.g. 24GiB (default: the profile's)")
    rep.add_argument("--search", action="store_true", help="rank every (tp, ring, ulysses) layout on --devices")
    rep.add_argument("--no-ring", action="store_true", help="search only ring=1 layouts (tp x ulysses)")
    rep.add_argument("--exhaustive", action="store_true",
                     help="--search partitions every layout whole (default: costed from cuts of the repeated blocks, "
                          "layouts whose compute alone is slower than the best found pruned)")
    rep.add_argument("--devices", type=int, default=8)
    rep.add_argument("--profile", default=planner.DEFAULT_PROFILE,
                     help="device profile: trn2, h100-nvlink, h200-nvlink, cpu-gloo, or a JSON file from calibrate")
    rep.add_argument("--tflops", type=_positive, help="override the profile's sustained matmul TFLOP/s")
    rep.add_argument("--link-gbps", type=_positive, help="override the profile's chip-to-chip GB/s")
    rep.add_argument("--json", action="store_true")
    rep.add_argument("--html", help="also write the (best) layout as a self-contained HTML picture")
    cal = commands.add_parser("calibrate", help="measure this machine's matmul rate, memory and gloo bandwidth")
    cal.add_argument("--out", default="cpu-gloo.json", help="where to write the profile (JSON)")
    cal.add_argument("--threads", type=lambda text: int(_positive(text)), default=1,
                     help="threads of one rank's process")
    args = parser.parse_args(argv)
    try:
        return calibrate(args) if args.command == "calibrate" else report(args)
    except (ValueError, MeshError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
