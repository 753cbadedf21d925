"""Every model a diffusion pipeline carries, at the front door: each transformer class of the installed diffusers
(listed from the package) and the text-encoder families its pipelines carry (``partitioner.testing.catalog``).

    python benchmarks/models.py [--models FluxTransformer2DModel T5EncoderModel ...] [--no-numerics] [--write]

Each model with an input builder is built tiny and random, with inputs as its pipeline builds them (odd text
lengths under sequence layouts), and planned for TP=2, Ulysses=2, TP=2 x Ulysses=2 and ring=2 on axis sizes (no
process group: ``planning.coverage``): the share of Linear weight bytes tp splits, the attentions whose rows are
split, and each shortfall as a kind of ``coverage.Shortfall``. Then it is partitioned on 2 gloo ranks at TP=2 and
Ulysses=2 and every rank compared with the model (1e-5 of the output's magnitude). ``--write`` writes
docs/models.md.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

LAYOUTS = {"TP=2": {"tp": 2}, "Ulysses=2": {"ulysses": 2}, "TP=2 x Ulysses=2": {"tp": 2, "ulysses": 2},
           "ring=2": {"ring": 2}}
CHECKED = {"TP=2": ((2,), ("tp",)), "Ulysses=2": ((2,), ("ulysses",))}  # run on gloo, every rank compared


def _sizes(entry, layout: dict) -> dict:
    """Odd lengths under a sequence layout: the zoo's, else 7 text rows where the builder takes text."""
    import inspect

    from partitioner.frontend.pipeline_sizes import BUILDERS
    from partitioner.testing.zoo import ZOO, odd_sizes

    if not set(layout) & {"ulysses", "ring"}:
        return {}
    if entry.kind == "transformer" and entry.key in ZOO:
        return odd_sizes(entry.key)
    builder = BUILDERS[entry.key] if entry.kind == "transformer" else None
    return dict(text=7) if builder is None or "text" in inspect.signature(builder).parameters else {}


def _example(entry, mesh: dict):
    """The inputs for a layout: at odd lengths under a sequence layout, unless the model takes one fixed text length
    (a learned table of that many rows: its pipeline always pads to it), then at the builder's."""
    sizes = _sizes(entry, mesh)
    try:
        return entry.inputs(**sizes)
    except (ValueError, TypeError):  # (InputError is a ValueError)
        if not sizes:
            raise
        return entry.inputs()


def survey(names: list[str], numerics: bool) -> dict:
    """{model: {layout: (Coverage, checked result or None)}}."""
    from partitioner.planning.coverage import Coverage, Shortfall, coverage, refusal
    from partitioner.testing import RankPool
    from partitioner.testing.catalog import catalog, partition_case

    entries = catalog()
    rows: dict = {}
    for name in names:
        entry = entries[name]
        if entry.build is None:
            rows[name] = {layout: (Coverage(mesh, shortfalls=(Shortfall.NO_INPUT_BUILDER,)), None)
                          for layout, mesh in LAYOUTS.items()}
            continue
        rows[name], model = {}, None
        for layout, mesh in LAYOUTS.items():
            try:
                model = model if model is not None else entry.build()
                example = _example(entry, mesh)
            except Exception as error:  # noqa: BLE001  (every outcome is a row)
                failed = refusal({}, error)
                rows[name][layout] = (Coverage(mesh, shortfalls=(Shortfall.BUILD_FAILED,), error=failed.error), None)
                continue
            rows[name][layout] = (coverage(model, mesh, example), None)
        print(f"{name}: " + ", ".join(f"{layout} {found.status}" for layout, (found, _) in rows[name].items()),
              flush=True)
    if numerics:
        with RankPool(2) as pool:
            for name in names:
                for layout, (shape, axes) in CHECKED.items():
                    found, _ = rows[name][layout]
                    if found.status == "refused":
                        continue
                    entry = entries[name]
                    sizes = _sizes(entry, LAYOUTS[layout])
                    try:
                        entry.inputs(**sizes)
                    except (ValueError, TypeError):
                        sizes = {}  # (a fixed text length, as _example)
                    result = pool.run(partition_case, name, shape, axes, sizes or None)
                    rows[name][layout] = (_with_numerics(found, result), result)
    return rows


def _with_numerics(found, results: list[dict]):
    """The coverage with a shortfall for a rank that was not exact (or refused at partition)."""
    import dataclasses

    from partitioner.planning.coverage import Shortfall

    bad = [r for r in results if r["status"] != "exact"]
    if not bad:
        return found
    kind = {"wrong": Shortfall.INEXACT, "failed": Shortfall.FAILED}.get(bad[0]["status"], Shortfall.REFUSED)
    detail = bad[0].get("message") or f"error {bad[0].get('error')}"
    return dataclasses.replace(found, shortfalls=(*found.shortfalls, kind), error=detail[:300])


def _detail(found) -> str:
    from partitioner.planning.coverage import Shortfall

    if found.error:
        return found.error.replace("|", "/")[:160]
    parts = []
    if Shortfall.ATTENTION_WHOLE in found.shortfalls or Shortfall.AXIS_IDLE in found.shortfalls:
        whole = [f"{path}: {decided}" for path, decided in found.attentions.items() if not decided.sharded
                 and not decided.single_query]
        parts.append(whole[0] if whole else "no attention or convolution rows to split")
    if Shortfall.LINEARS_WHOLE in found.shortfalls:
        parts.append("whole: " + ", ".join(path + (f" (column sharding stopped at {found.whole_because[path]})"
                                                    if path in found.whole_because else "")
                                           for path in found.whole_linears[:2]))
    return "; ".join(parts).replace("|", "/")[:240]


def table(rows: dict) -> list[str]:
    from partitioner.testing.catalog import catalog

    entries = catalog()
    lines = ["| model | kind | layout | status | checked | tp share | attentions split | collectives | shortfall | "
             "detail |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, layouts in rows.items():
        for layout, (found, result) in layouts.items():
            share = "" if found.tp_share is None else f"{found.tp_share:.0%}"
            sharded, total = found.attentions_sharded
            attentions = f"{sharded}/{total}" if set(found.mesh) & {"ulysses", "ring"} and found.status != \
                "refused" else ""
            checked = "planned" if result is None else "exact" if found.status != "refused" else "run"
            collectives = "" if result is None or "collectives" not in result[0] else ", ".join(
                f"{kind} {n}" for kind, n in sorted(result[0]["collectives"].items()))
            lines.append(f"| {name} | {entries[name].kind} | {layout} | {found.status} | {checked} | {share} | "
                         f"{attentions} | {collectives} | {', '.join(map(str, found.shortfalls))} | "
                         f"{_detail(found)} |")
    return lines


def summary(rows: dict) -> list[str]:
    from partitioner.planning.coverage import Shortfall

    models = len(rows)
    built = sum(1 for layouts in rows.values() if not any(Shortfall.NO_INPUT_BUILDER in found.shortfalls
                                                          for found, _ in layouts.values()))
    all_ok = sum(1 for layouts in rows.values() if all(found.status == "ok" for found, _ in layouts.values()))
    cells = [found for layouts in rows.values() for found, _ in layouts.values()]
    counts = {kind: sum(kind in found.shortfalls for found in cells) for kind in Shortfall}
    return [f"{models} models ({built} with an input builder); ok in all four layouts: {all_ok}; "
            f"layouts ok / partial / refused: {sum(f.status == 'ok' for f in cells)} / "
            f"{sum(f.status == 'partial' for f in cells)} / {sum(f.status == 'refused' for f in cells)}.", "",
            "Shortfalls over all model x layout cells: " + ", ".join(f"{kind} {n}" for kind, n in counts.items()
                                                                     if n) + "."]


def main() -> None:
    from partitioner.testing.catalog import catalog

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="class names (default: every row of the catalog)")
    parser.add_argument("--no-numerics", action="store_true", help="plan only (no gloo ranks)")
    parser.add_argument("--write", action="store_true", help="write docs/models.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    rows = survey(args.models or list(catalog()), numerics=not args.no_numerics)
    lines = summary(rows) + [""] + table(rows)
    print("\n".join(lines))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.write:
        path = Path(__file__).resolve().parent.parent / "docs" / "models.md"
        text = path.read_text()
        begin, end = "<!-- models table: benchmarks/models.py --write -->", "<!-- end of models table -->"
        head, rest = text.split(begin)
        if args.models:  # the listed models' rows replaced in the written table, its summary counted again
            lines = merged(text.split(begin)[1].split(end)[0], table(rows)[2:])
        path.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end)[1])


def merged(written: str, new_rows: list[str]) -> list[str]:
    """The written table with the rows of the models in ``new_rows`` replaced, and its summary counted from the
    rows (model, status and shortfall columns)."""
    from partitioner.planning.coverage import Shortfall

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]
    replaced = {cells(line)[0] for line in new_rows}
    old_rows = [line for line in written.splitlines() if line.startswith("| ") and not line.startswith("| model |")]
    rows = [line for line in old_rows if cells(line)[0] not in replaced]
    rows += new_rows
    order = list(dict.fromkeys(cells(line)[0] for line in old_rows + new_rows))
    rows.sort(key=lambda line: order.index(cells(line)[0]))  # (stable: layouts keep their order)
    by_model: dict[str, list[list[str]]] = {}
    for line in rows:
        by_model.setdefault(cells(line)[0], []).append(cells(line))
    statuses = [row[3] for row in sum(by_model.values(), [])]
    shortfalls = [kind for row in sum(by_model.values(), []) for kind in row[8].split(", ") if kind]
    built = sum(1 for model in by_model.values() if not any(str(Shortfall.NO_INPUT_BUILDER) in r[8] for r in model))
    all_ok = sum(1 for model in by_model.values() if all(r[3] == "ok" for r in model))
    counts = {str(kind): shortfalls.count(str(kind)) for kind in Shortfall}
    return [f"{len(by_model)} models ({built} with an input builder); ok in all four layouts: {all_ok}; "
            f"layouts ok / partial / refused: {statuses.count('ok')} / {statuses.count('partial')} / "
            f"{statuses.count('refused')}.", "",
            "Shortfalls over all model x layout cells: " + ", ".join(f"{kind} {n}" for kind, n in counts.items()
                                                                     if n) + ".", "",
            "| model | kind | layout | status | checked | tp share | attentions split | collectives | shortfall | "
            "detail |", "|---|---|---|---|---|---|---|---|---|---|"] + rows


if __name__ == "__main__":
    main()
