"""The model zoo, as a new user would try it: every diffusers transformer of ``partitioner.testing.zoo``.

    python benchmarks/zoo.py [--models flux wan ...] [--full-tp 8] [--skip-full]

Two tables:
1. tiny random models (CPU, gloo ranks) in TP=2, Ulysses=2 and TP=2 x Ulysses=2: exact against the unpartitioned
   model or refused (and why), the share of parameter bytes replicated, collectives per transformer block
   (all_reduce over tp, all_to_all over ulysses), attentions sequence-sharded, partition seconds;
2. the production-size config traced on the meta device with production-size inputs (``PRODUCTION``) and planned
   at TP=--full-tp (no process group, no memory): the share of parameter bytes every rank holds whole, and the
   largest replicated modules.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter


def tiny_table(models: list[str]) -> list[str]:
    from partitioner.testing import RankPool
    from partitioner.testing.zoo import MODES, partition_case

    rows = {}
    for world, modes in ((2, ("tp2", "ulysses2")), (4, ("tp2xulysses2",))):
        with RankPool(world) as pool:
            for name in models:
                for mode in modes:
                    rows[(name, mode)] = pool.run(partition_case, name, *MODES[mode])[0]
    lines = ["| model | mode | result | replicated | all_reduce/block | all_to_all/block | attentions sharded | "
             "partition s |", "|---|---|---|---|---|---|---|---|"]
    for name in models:
        blocks = _blocks(name)
        for mode in MODES:
            row = rows[(name, mode)]
            if row["status"] != "exact":
                lines.append(f"| {name} | {mode} | {row['status']}: {row.get('error_type', '')} "
                             f"{row.get('message', row.get('error', ''))[:90]} | | | | | |")
                continue
            counts = row["collectives"]
            lines.append(f"| {name} | {mode} | exact ({row['error']:.0e}) | {row['replicated']:.1%} | "
                         f"{counts.get('all_reduce:tp', 0) / blocks:.1f} | "
                         f"{counts.get('all_to_all:ulysses', 0) / blocks:.1f} | "
                         f"{row['attention_sharded']}/{row['attentions']} | {row['seconds']:.1f} |")
    return lines


def _blocks(name: str) -> int:
    """Transformer blocks of the tiny model (every ModuleList of modules with an attention), at least 1."""
    from partitioner.testing.zoo import build

    model = build(name)
    count = 0
    for module in model.modules():
        if isinstance(module, __import__("torch").nn.ModuleList):
            count += sum(any("attn" in child_name for child_name, _ in block.named_children()) for block in module)
    return max(count, 1)


def full_table(models: list[str], degree: int) -> list[str]:
    import torch

    from partitioner import partition
    from partitioner.errors import PartitionerError
    from partitioner.testing.zoo import ZOO, build, config

    lines = [f"| model | params | replicated at TP={degree} | largest replicated | plan s |", "|---|---|---|---|---|"]
    for name in models:
        if ZOO[name].full is None:
            continue
        model = build(name, full=True)
        args, kwargs = ZOO[name].make_inputs(config(name, full=True), 0, **_production_sizes(ZOO[name].make_inputs))
        # float inputs to the meta device; masks and ids keep their values (a model that reads them is traced
        # for them, value_specialization; trace moves them to meta after reading them)
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        args = tuple(to_meta(a) for a in args)
        kwargs = {k: torch.utils._pytree.tree_map(to_meta, v) for k, v in kwargs.items()}
        params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                partitioned = partition(model, {"tp": degree}, (args, kwargs))
        except PartitionerError as error:
            lines.append(f"| {name} | {params / 1e9:.1f}B | refused: {type(error).__name__} "
                         f"{str(error).splitlines()[0][:80]} | | |")
            continue
        seconds = time.perf_counter() - start
        report = partitioned.report()
        replicated = Counter()
        for path, style in partitioned.linear_styles.items():
            if style.startswith("replicate"):
                module = model.get_submodule(path)
                replicated[_pattern(path)] += sum(p.numel() for p in module.parameters())
        largest = ", ".join(f"{p} {n / params:.1%}" for p, n in replicated.most_common(2))
        lines.append(f"| {name} | {params / 1e9:.1f}B | {report.replicated_share:.1%} | {largest} | {seconds:.0f} |")
        print(lines[-1], flush=True)
    return lines


# Sizes of a production call (the plan depends on them: a Linear over few rows is split row-wise): a 1024x1024 image
# or a short 480p video in latent units, 256 text tokens; traced on the meta device, they cost nothing.
PRODUCTION = dict(text=256, height=128, width=128, frames=8, video=4096, audio=256)


def _production_sizes(make_inputs) -> dict:
    """The PRODUCTION sizes this input builder takes (video builders get a smaller frame)."""
    import inspect

    accepted = {name for name, p in inspect.signature(make_inputs).parameters.items() if p.kind is p.KEYWORD_ONLY}
    sizes = {name: size for name, size in PRODUCTION.items() if name in accepted}
    if "frames" in sizes:
        sizes.update(height=60, width=104)
    return sizes


def _pattern(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def main() -> None:
    from partitioner.testing.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--full-tp", type=int, default=8)
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    if not args.skip_tiny:
        print("\n".join(tiny_table(args.models)), flush=True)
    if not args.skip_full:
        print()
        print("\n".join(full_table(args.models, args.full_tp)))


if __name__ == "__main__":
    main()
