"""Quantised weights and low-precision exchanges, side by side in one run.

    python benchmarks/quantized.py [--models flux wan ...] [--skip-zoo] [--skip-pipelines] [--skip-h3] [--write]

Three tables (``--write`` puts them in docs/quantized.md between its markers):
1. zoo: every tiny zoo transformer quantised with torchao (int8 and float8 weight-only) at TP=2, against its
   quantised single-device self, with the share of parameter bytes every rank holds whole (the float model's
   beside it); and at Ulysses=2 the relative L2 error of the output with the all_to_all in float8 (e4m3, per-row
   scales) and in bfloat16, with the bytes each all_to_all sends per step against the exact run's;
2. pipelines: Flux, SD3, Wan and Qwen-Image (tiny, 3 steps) through ``parallelize`` at Ulysses=2 with
   ``exchange_dtype``: relative L2 of the denoised latents and of the decoded output;
3. full-size MiniMax-H3 (33B) on the meta device, planned for rank 0 of TP=8 and TP=8 x Ulysses=4: per-rank
   parameter bytes and bytes sent per step, bf16 weights against torchao's float8 weights (its own tensors, on
   meta) and against float8 exchanges;
4. with ``--timing N``: step times (medians of N interleaved steps) of the mid-size H3 of ``tp_step.py`` in bf16
   on 2 gloo ranks: Ulysses=2 with the exchange in bf16 and in e4m3, TP=2 with bf16 and float8 weights.
The float8 exchange's bytes depend on the row it scales: a float32 scale per ``head_dim`` elements, so
(1 + 4/head_dim)/2 of bf16 (0.516 at H3's 128; the tiny models' 16 give 0.625).
"""

from __future__ import annotations

import argparse
import re
import time
import warnings
from pathlib import Path

import torch

E4M3 = torch.float8_e4m3fn


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)).item()


def _zoo_case(rank: int, world: int, name: str) -> dict:
    """One zoo model: quantised weights at TP=2, exchanges at Ulysses=2 (this rank's view)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    import partitioner
    from partitioner.errors import PartitionerError
    from partitioner.testing.zoo import build, inputs
    from partitioner.testing.zoo_check import _first_tensor

    args, kwargs = inputs(name)
    row = {}
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for label, config in (("float", None), ("int8", Int8WeightOnlyConfig()), ("float8", Float8WeightOnlyConfig())):
        model = build(name)
        if config is not None:
            quantize_(model, config)
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                expected = _first_tensor(model(*args, **kwargs))
                partitioned = partitioner.partition(model, tp, (args, kwargs))
                got = _first_tensor(partitioned.compile()(*args, **kwargs))
            row[label] = dict(error=_relative(got, expected), replicated=partitioned.report().replicated_share,
                              whole=len(partitioned.ctx.whole_quantised))
        except (PartitionerError, RuntimeError) as error:
            row[label] = dict(failed=f"{type(error).__name__}: {str(error).splitlines()[0][:80]}")
    model = build(name)
    ulysses = init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",))
    with torch.no_grad():
        expected = _first_tensor(model(*args, **kwargs))
    for label, dtype in (("exact", None), ("e4m3", E4M3), ("bf16", torch.bfloat16)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                partitioned = partitioner.partition(model, ulysses, (args, kwargs), exchange_dtype=dtype)
                got = _first_tensor(partitioned.compile()(*args, **kwargs))
            sent = sum(c.count * c.bytes_per_call for c in partitioned.report().collectives if c.kind == "all_to_all")
            row[label] = dict(error=_relative(got, expected), sent=sent)
        except PartitionerError as error:
            row[label] = dict(failed=f"{type(error).__name__}: {str(error).splitlines()[0][:80]}")
    return row


def _cell(result: dict, key: str, fmt: str) -> str:
    return f"failed ({result['failed']})" if "failed" in result else format(result[key], fmt)


def zoo_table(models: list[str]) -> list[str]:
    from partitioner.testing import RankPool

    lines = ["| model | int8 TP=2 error | float8 TP=2 error | replicated: float / int8 / float8 | U=2 e4m3 error | "
             "U=2 bf16 error | all_to_all bytes e4m3 / exact |", "|---|---|---|---|---|---|---|"]
    with RankPool(2) as pool:
        for name in models:
            row = pool.run(_zoo_case, name, timeout=900)[0]
            shares = " / ".join("-" if "failed" in row[k] else f"{row[k]['replicated']:.0%}"
                                for k in ("float", "int8", "float8"))
            exact = row["exact"].get("sent") or 0
            ratio = f"{row['e4m3']['sent'] / exact:.3f}" if exact and "sent" in row["e4m3"] else "no all_to_all"
            lines.append(f"| {name} | {_cell(row['int8'], 'error', '.1e')} | {_cell(row['float8'], 'error', '.1e')}"
                         f" | {shares} | {_cell(row['e4m3'], 'error', '.1e')} | {_cell(row['bf16'], 'error', '.1e')}"
                         f" | {ratio} |")
            print(lines[-1], flush=True)
    return lines


def _pipeline_case(rank: int, world: int, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing.pipelines import BUILDERS, run

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",))
    expected_steps, expected_output = run(BUILDERS[name](), name)
    row = {}
    for label, dtype in (("exact", None), ("e4m3", E4M3), ("bf16", torch.bfloat16)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps, output = run(partitioner.parallelize(BUILDERS[name](), mesh, exchange_dtype=dtype), name)
        row[label] = (_relative(steps[-1], expected_steps[-1]), _relative(output, expected_output))
    return row


def pipeline_table(names: list[str]) -> list[str]:
    from partitioner.testing import RankPool

    lines = ["| pipeline | exact: latents / output | e4m3: latents / output | bf16: latents / output |",
             "|---|---|---|---|"]
    with RankPool(2) as pool:
        for name in names:
            row = pool.run(_pipeline_case, name, timeout=900)[0]
            lines.append(f"| {name} | " + " | ".join(f"{row[k][0]:.1e} / {row[k][1]:.1e}"
                                                      for k in ("exact", "e4m3", "bf16")) + " |")
            print(lines[-1], flush=True)
    return lines


def h3_table() -> list[str]:
    """Full-size H3 on meta, rank 0's program planned from axis sizes (no process group, no memory)."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    import partitioner
    from partitioner.planning.report import human_bytes
    from partitioner.testing.models import full_h3_on_meta

    lines = ["| layout | weights | exchange | parameters per rank | sent per step: all_reduce / all_to_all / "
             "all_gather | partition s |", "|---|---|---|---|---|---|"]
    for layout in ({"tp": 8}, {"tp": 8, "ulysses": 4}):
        for weights, exchange in (("bf16", None), ("float8", None), ("bf16", E4M3), ("float8", E4M3)):
            if exchange is not None and "ulysses" not in layout:
                continue
            model, inputs = full_h3_on_meta()
            model = model.to(torch.bfloat16).eval()
            inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
            if weights == "float8":
                quantize_(model, Float8WeightOnlyConfig())
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = partitioner.partition(model, layout, ((), inputs), exchange_dtype=exchange).report()
            sent = {kind: sum(c.count * c.bytes_per_call for c in report.collectives if c.kind == kind)
                    for kind in ("all_reduce", "all_to_all", "all_gather")}
            lines.append(f"| {' x '.join(f'{a}={n}' for a, n in layout.items())} | {weights} | "
                         f"{exchange or 'bf16'} | {human_bytes(report.total_parameter_bytes)} | "
                         + " / ".join(human_bytes(sent[k]) for k in sent)
                         + f" | {time.perf_counter() - start:.0f} |")
            print(lines[-1], flush=True)
    return lines


def _timing_case(rank: int, world: int, repeats: int) -> dict:
    """The mid-size H3 of ``tp_step.py`` in bf16 (one thread per rank): step times of interleaved variants, each
    step of every variant in turn, ranks synchronised by a barrier around every step."""
    import os
    import statistics
    import sys

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    import partitioner

    sys.path.insert(0, os.path.dirname(__file__))
    from tp_step import MID, ROWS, _inputs, _model

    torch.set_num_threads(1)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _inputs(MID, ROWS).items()}
    variants = {}
    for label, axis, weights, exchange in (("Ulysses=2, bf16 exchange", "ulysses", "bf16", None),
                                           ("Ulysses=2, e4m3 exchange", "ulysses", "bf16", E4M3),
                                           ("TP=2, bf16 weights", "tp", "bf16", None),
                                           ("TP=2, float8 weights", "tp", "float8", None)):
        model = _model(MID).to(torch.bfloat16).eval()
        if weights == "float8":
            quantize_(model, Float8WeightOnlyConfig())
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = partitioner.partition(model, mesh, ((), inputs), exchange_dtype=exchange).compile()
        variants[label] = compiled
    times = {label: [] for label in variants}
    with torch.no_grad():
        for step in range(repeats + 2):
            for label, compiled in variants.items():
                dist.barrier()
                start = time.perf_counter()
                compiled(**inputs, return_dict=False)
                dist.barrier()
                if step >= 2:  # (two warm-up steps)
                    times[label].append(time.perf_counter() - start)
    return {label: (statistics.median(t), min(t), max(t)) for label, t in times.items()}


def timing_table(repeats: int) -> list[str]:
    from partitioner.testing import run_ranks

    found = run_ranks(2, _timing_case, repeats)[0]
    lines = ["| variant (mid-size H3, bf16, 2 gloo ranks) | ms/step median | range | vs its bf16 row |",
             "|---|---|---|---|"]
    for label, (median, low, high) in found.items():
        base = found["Ulysses=2, bf16 exchange" if "Ulysses" in label else "TP=2, bf16 weights"][0]
        lines.append(f"| {label} | {median * 1e3:.0f} | {low * 1e3:.0f}-{high * 1e3:.0f} | {median / base:.2f}x |")
    return lines


def _write(sections: dict[str, list[str]]) -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "quantized.md"
    text = path.read_text()
    stamp = f"(`python benchmarks/quantized.py --write`, {time.strftime('%Y-%m-%d')}, 2-core CPU, gloo)"
    for key, lines in sections.items():
        pattern = re.compile(rf"(<!-- {key} -->\n).*?(<!-- /{key} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + stamp + "\n\n" + "\n".join(lines) + "\n" + m.group(2), text)
    path.write_text(text)


def main() -> None:
    from partitioner.testing.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--pipelines", nargs="*", default=["flux", "sd3", "wan", "qwen_image"])
    parser.add_argument("--skip-zoo", action="store_true")
    parser.add_argument("--skip-pipelines", action="store_true")
    parser.add_argument("--skip-h3", action="store_true")
    parser.add_argument("--timing", type=int, default=0, metavar="REPEATS",
                        help="also time the variants side by side (interleaved steps; a quiet machine)")
    parser.add_argument("--write", action="store_true", help="write the tables into docs/quantized.md")
    options = parser.parse_args()
    sections = {}
    if not options.skip_h3:
        sections["h3"] = h3_table()
    if not options.skip_pipelines:
        sections["pipelines"] = pipeline_table(options.pipelines)
    if not options.skip_zoo:
        sections["zoo"] = zoo_table(options.models)
    if options.timing:
        sections["timing"] = timing_table(options.timing)
    for lines in sections.values():
        print("\n".join(lines) + "\n")
    if options.write:
        _write(sections)


if __name__ == "__main__":
    main()
