"""``python -m partitioner``: plan, report, dump and verify any diffusers model from the command line; calibrate.

    python -m partitioner plan --model FluxTransformer2DModel --mesh tp=2,ulysses=2 [--preset 1024x768]
        [--size text=77] [--config key=value | --config config.json | --pretrained FOLDER] [--json] [--html F]
    python -m partitioner report --model minimax-h3 --mesh tp=8,ring=2,ulysses=4 --seq-len 37888 \\
        --dtype bfloat16 --device-memory 24GiB [--json] [--html plan.html] [--profile trn2]
    python -m partitioner report --model minimax-h3 --search --devices 64 --device-memory 24GiB --seq-len 37888
    python -m partitioner dump --model WanTransformer3DModel --mesh ulysses=2 --out dumps/ [--ranks 0,1]
    torchrun --nproc-per-node 2 -m partitioner verify --model FluxTransformer2DModel --config num_layers=1 \\
        --mesh tp=2 --size text=7,height=8,width=8 --dtype float32
    python -m partitioner calibrate --out cpu.json [--threads 1]

A model is named by its diffusers class (``--model``, or ``minimax-h3``) with a config (JSON files, a folder, or
``key=value`` pairs over the class defaults), or by a ``from_pretrained`` folder (``--pretrained``); it is built on
the meta device (``verify``: with random weights seeded alike on every rank, or the folder's own), and called with
inputs built as its pipeline builds them at the pipeline's usual sizes (``--preset``) or the sizes given
(``--size``). Exit codes: 0 done, 2 the arguments (an ``InputError``/``MeshError``: the message says what to fix),
1 the model cannot be partitioned or verified as asked (the package's error, named).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .errors import InputError, MeshError, NotFound, PartitionerError, TraceError
from .frontend.model_source import build_model
from .frontend.pipeline_sizes import pipeline_example
from .frontend.trace import trace
from .mesh import KNOWN_AXES
from .planning import cost, planner


def _pairs(text: str, what: str) -> dict[str, int]:
    try:
        pairs = [item.split("=") for item in text.split(",") if item]
        return {name.strip(): int(size) for name, size in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} takes name=integer pairs such as "
                                         f"{'tp=8,ulysses=4' if what == '--mesh' else 'text=77,height=64'}, "
                                         f"got {text!r}")


def _mesh(text: str) -> dict[str, int]:
    return _pairs(text, "--mesh")


def _sizes(text: str) -> dict[str, int]:
    return _pairs(text, "--size")


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


def _model(args, weights: str = "meta") -> torch.nn.Module:
    return build_model(args.model, args.config, args.pretrained, dtype=getattr(torch, args.dtype), weights=weights)


def _example(args, model: torch.nn.Module, meta: bool = True):
    """The inputs ``model`` is planned with: H3 at ``--seq-len`` packed rows, else as its pipeline builds them."""
    dtype = getattr(torch, args.dtype)
    if args.seq_len is not None:
        return planner.example_inputs(model, args.seq_len, dtype)
    args_, kwargs = pipeline_example(model, args.preset, meta=meta, **args.size)
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return tuple(map(cast, args_)), {k: torch.utils._pytree.tree_map(cast, v) for k, v in kwargs.items()}


def _with_example(args, model: torch.nn.Module, use):
    """``use(example)`` with float inputs on meta; again with real ones where the model branches on their values
    (a Python branch on a float input is traced for the example's values: ``docs/data-dependent.md``)."""
    try:
        return use(_example(args, model))
    except TraceError:
        if args.seq_len is not None or not any(p.is_meta for p in model.parameters()):
            raise
        return use(_example(args, model, meta=False))


def report(args) -> int:
    mesh = args.mesh or {"tp": 1}
    unknown = set(mesh) - {"tp", "ring", "ulysses"}
    if unknown:
        raise MeshError(f"unknown mesh dim names {sorted(unknown)}: use tp, ring and ulysses")
    profile = cost.with_overrides(cost.load_profile(args.profile), matmul_tflops=args.tflops,
                                  link_gbps=args.link_gbps)
    memory = planner.parse_bytes(args.device_memory) if args.device_memory else profile.memory_bytes
    model = _model(args)
    traced = _with_example(args, model, lambda example: trace(model, example))
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


def plan(args) -> int:
    """The plan of one rank of the mesh: every decision, this rank's memory and collectives (``Partitioned.report``)."""
    from .api import partition
    from .plans import Plan

    model = _model(args)
    partitioned = _with_example(args, model, lambda example: partition(model, args.mesh, example, rank=args.rank))
    decided = Plan.of(partitioned)
    if args.json:
        print(decided.to_json())
    else:
        print(f"{type(model).__name__} on {partitioned.mesh}")
        print(partitioned.report())
        width = max(map(len, [*decided.linears, *decided.attention]), default=0)
        print("linears:")
        print("\n".join(f"  {path:<{width}}  {style}" for path, style in decided.linears.items()))
        print("attentions:")
        print("\n".join(f"  {path:<{width}}  {why}" for path, why in decided.attention.items()) or "  none")
    if args.html:
        from .planning.plan_view import write_html

        write_html(partitioned, args.html)
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def dump(args) -> int:
    """Each rank's program, pass by pass, into ``--out/rank<N>`` (planned on axis sizes: no process group)."""
    from .api import partition
    from .mesh import as_mesh_spec

    world = as_mesh_spec(args.mesh).world_size
    ranks = range(world) if args.ranks is None else args.ranks
    for rank in ranks:
        if not 0 <= rank < world:
            raise MeshError(f"--ranks {rank} is outside the mesh {args.mesh} of {world} ranks")
    model = _model(args)
    for rank in ranks:
        _with_example(args, model, lambda example: partition(model, args.mesh, example, rank=rank, dump_dir=args.out))
        print(f"wrote {Path(args.out) / f'rank{rank}'}", file=sys.stderr)
    return 0


def verify(args) -> int:
    """Under torchrun: every rank builds the model with the same weights, partitions it on a DeviceMesh of the
    given sizes and compares every value it computes with the unpartitioned model (``Partitioned.verify``)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .api import partition

    if "WORLD_SIZE" not in os.environ:
        raise InputError("verify runs one process per rank: launch it with torchrun --nproc-per-node "
                         f"{math.prod(args.mesh.values())} -m partitioner verify ...")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        mesh = init_device_mesh("cuda" if cuda else "cpu", tuple(args.mesh.values()),
                                mesh_dim_names=tuple(args.mesh))
        model = _model(args, weights="pretrained" if args.pretrained else "random")
        example_args, example_kwargs = _example(args, model)
        partitioned = partition(model, mesh, (example_args, example_kwargs))
        result = partitioned.verify(*example_args, **example_kwargs, rtol=args.rtol, atol=args.atol)
        if dist.get_rank() == 0:
            print(f"{type(model).__name__} over {args.mesh}: every rank's {result.nodes_checked} values match the "
                  f"unpartitioned model (largest error {result.max_error:.2g}, at the outputs "
                  f"{result.output_error:.2g}; rtol={args.rtol}, atol={args.atol})")
    finally:
        dist.destroy_process_group()
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


def _add_model_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a diffusers model class (FluxTransformer2DModel, ...) or minimax-h3")
    parser.add_argument("--config", action="append", default=[], metavar="JSON|KEY=VALUE",
                        help="the model's config: a config.json, the folder holding it, or key=value over the class "
                             "defaults (repeatable, applied in order)")
    parser.add_argument("--pretrained", help="a from_pretrained folder: its config (and for verify its weights)")
    parser.add_argument("--preset", help="input sizes of one of the pipeline's usual resolutions (default: the first)")
    parser.add_argument("--size", type=_sizes, default={}, help="input sizes over the preset's, e.g. text=77,height=64")
    parser.add_argument("--seq-len", type=int, help="MiniMax-H3 only: packed rows of one request")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partitioner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pln = commands.add_parser("plan", help="one rank's plan: every decision, its memory and collectives")
    _add_model_source(pln)
    pln.add_argument("--mesh", type=_mesh, required=True,
                     help=f"axis sizes from {list(KNOWN_AXES)}, e.g. tp=2,ulysses=2")
    pln.add_argument("--rank", type=int, default=0)
    pln.add_argument("--json", action="store_true", help="the Plan as JSON (Plan.from_json reads it)")
    pln.add_argument("--html", help="also write the plan as a self-contained HTML picture")
    rep = commands.add_parser("report", help="per-rank memory, communication and step estimate of a layout")
    _add_model_source(rep)
    rep.add_argument("--mesh", type=_mesh, help="axis sizes, e.g. tp=8,ring=2,ulysses=4")
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
    dmp = commands.add_parser("dump", help="each rank's program after every pass, one folder per rank")
    _add_model_source(dmp)
    dmp.add_argument("--mesh", type=_mesh, required=True)
    dmp.add_argument("--out", required=True, help="the folder to write rank<N>/ into")
    dmp.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], help="e.g. 0,1 (default: all)")
    ver = commands.add_parser("verify", help="under torchrun: every rank's values against the unpartitioned model")
    _add_model_source(ver)
    ver.add_argument("--mesh", type=_mesh, required=True)
    ver.add_argument("--rtol", type=float, default=1e-4)
    ver.add_argument("--atol", type=float, default=1e-5)
    cal = commands.add_parser("calibrate", help="measure this machine's matmul rate, memory and gloo bandwidth")
    cal.add_argument("--out", default="cpu-gloo.json", help="where to write the profile (JSON)")
    cal.add_argument("--threads", type=lambda text: int(_positive(text)), default=1,
                     help="threads of one rank's process")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "calibrate" and not (args.model or args.config or args.pretrained):
        print("error: name the model: --model CLASS, --config config.json or --pretrained FOLDER", file=sys.stderr)
        return 2
    command = {"plan": plan, "report": report, "dump": dump, "verify": verify, "calibrate": calibrate}[args.command]
    try:
        return command(args)
    except (InputError, MeshError, NotFound) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except PartitionerError as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
