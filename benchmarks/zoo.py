"""The model zoo, as a new user would try it: every diffusers transformer of ``partitioner.testing.zoo``.

    python benchmarks/zoo.py [--models flux wan ...] [--full-tp 8] [--skip-full]

Two tables:
1. tiny random models (CPU, gloo ranks) in TP=2, Ulysses=2 and TP=2 x Ulysses=2: exact against the unpartitioned
   model or refused (and why), the share of parameter bytes replicated, collectives per transformer block
   (all_reduce over tp, all_to_all over ulysses), attentions sequence-sharded, partition seconds;
2. the production-size config traced on the meta device at the sizes its pipeline passes (``PIPELINE_SIZES``:
   odd text lengths, row counts equal to a feature width) and planned (no process group, no memory) at
   TP=--full-tp: the share of parameters every rank holds whole; and at Ulysses 2, 4, 8 and ring 2: the
   attentions sequence-sharded, with the first reason one is left whole.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter


def tiny_table(models: list[str]) -> list[str]:
    from partitioner.testing import RankPool
    from partitioner.testing.zoo_check import MODES, partition_case

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


SEQUENCE_MESHES = (("ulysses", 2), ("ulysses", 4), ("ulysses", 8), ("ring", 2))


def _cells(traced, model, name: str, degree: int, params: int) -> list[str]:
    """The replicated share at TP=``degree`` and the attentions sequence-sharded at each of ``SEQUENCE_MESHES``
    (rank programs, as a DeviceMesh partition plans), each decided on its own copy of ``traced``."""
    from partitioner.frontend.trace import copy_graph_module
    from partitioner.mesh import as_mesh_spec
    from partitioner.build import decide
    from partitioner.passes.plan_sequence import attention_counts

    cells = [_replicated(model, decide(_copy(traced, copy_graph_module), as_mesh_spec(
        {"tp": degree}, programs="rank"), name), params)]
    for axis, n in SEQUENCE_MESHES:
        ctx = decide(_copy(traced, copy_graph_module), as_mesh_spec({axis: n}, programs="rank"), name)[0]
        sharded, total = attention_counts(ctx)
        first = next(iter(ctx.sequence_whole.values()), "")
        cells.append(f"{sharded}/{total}" + (f" ({first[:60]})" if first else ""))
    return cells


def full_table(models: list[str], degree: int, sizes: str | None = None) -> list[str]:
    """Each model's production config on the meta device at the sizes its pipeline passes (``PIPELINE_SIZES``),
    traced once per size and planned for rank programs (as a DeviceMesh partition plans): the share of parameter
    bytes every rank holds whole at TP=``degree``, and the attentions sequence-sharded at each of
    ``SEQUENCE_MESHES``, with the first reason one is left whole."""
    from partitioner.errors import DataDependentNumber, PartitionerError, TraceError
    from partitioner.frontend.trace import trace
    from partitioner.frontend.pipeline_sizes import meta_floats
    from partitioner.testing.zoo import PIPELINE_SIZES, ZOO, build, config

    heads = " | ".join(f"{axis}={n}" for axis, n in SEQUENCE_MESHES)
    lines = [f"| model | size | params | replicated at TP={degree} | attentions sequence-sharded: {heads} | "
             "plan s |", "|---|---|---|---|" + "---|" * len(SEQUENCE_MESHES) + "---|"]
    for name in models:
        if ZOO[name].full is None:
            continue
        for label, shape in PIPELINE_SIZES.get(name, {}).items():
            if sizes and sizes not in label:
                continue
            model = build(name, full=True)
            params = sum(p.numel() for p in model.parameters())
            args, kwargs = meta_floats(ZOO[name].make_inputs(config(name, full=True), 0, **shape))
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        try:
                            traced = trace(model, (args, kwargs))
                        except TraceError:  # a branch on a float input's values: given with its values, guarded
                            args, kwargs = ZOO[name].make_inputs(config(name, full=True), 0, **shape)
                            traced = trace(model, (args, kwargs))
                        cells = _cells(traced, model, name, degree, params)
                    except DataDependentNumber:  # as partition() does: traced again for its masks' values
                        cells = _cells(trace(model, (args, kwargs), specialize_values=True), model, name, degree,
                                       params)
            except PartitionerError as error:
                lines.append(f"| {name} | {label} | {params / 1e9:.1f}B | refused: {type(error).__name__} "
                             f"{str(error).splitlines()[0][:80]} |" + " |" * (len(SEQUENCE_MESHES) + 1))
                print(lines[-1], flush=True)
                continue
            seconds = (time.perf_counter() - start) / (1 + len(SEQUENCE_MESHES))
            lines.append(f"| {name} | {label} | {params / 1e9:.1f}B | " + " | ".join(cells) + f" | {seconds:.0f} |")
            print(lines[-1], flush=True)
    return lines


def _copy(traced, copy_graph_module):
    """A trace to plan once more (planning rewrites its graph in place)."""
    import dataclasses

    return dataclasses.replace(traced, graph_module=copy_graph_module(traced.graph_module),
                               inputs=list(traced.inputs))


def _replicated(model, planned, params: int) -> str:
    """The share of parameters every rank holds whole (no axis shards them in the planned graph), with the
    largest replicated module pattern."""
    from partitioner.annotations import annotation
    from partitioner.placement import is_sharded

    ctx, gm = planned[0], planned[1]
    replicated = Counter()
    for node, graph_input in ctx.placeholder_inputs(gm).items():
        if graph_input.kind == "parameter" and not any(map(is_sharded, annotation(node).placements.values())):
            replicated[_pattern(graph_input.target.rsplit(".", 1)[0])] += node.meta["val"].numel()
    share = sum(replicated.values()) / params
    largest = ", ".join(f"{p} {n / params:.1%}" for p, n in replicated.most_common(1))
    return f"{share:.1%}" + (f" ({largest})" if largest and share > 0.005 else "")


def _pattern(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def main() -> None:
    from partitioner.testing.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--full-tp", type=int, default=8)
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--sizes", help="only the pipeline sizes whose label contains this, e.g. 1024x768")
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    if not args.skip_tiny:
        print("\n".join(tiny_table(args.models)), flush=True)
    if not args.skip_full:
        print()
        print("\n".join(full_table(args.models, args.full_tp, args.sizes)))


if __name__ == "__main__":
    main()
