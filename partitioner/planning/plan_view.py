"""The plan as a picture: one self-contained HTML page (inline CSS, no scripts to run, nothing fetched) with the
blocks as rows, each Linear's placement as a coloured cell, each block's collectives and their bytes, per-rank
memory as bars and, when the caller has them, the step time split into compute and communication.

``plan_summary`` gathers the numbers as a JSON-able dict; ``render_html`` draws that dict and embeds it in the page
(``<script type="application/json" id="plan-data">``) so that tools can read the numbers back; ``write_html`` does
both. ``partition(..., dump_dir=DIR)`` writes ``DIR/plan.html``."""

from __future__ import annotations

import html
import json
from collections import deque
from pathlib import Path

from ..errors import InputError
from ..passes.annotate_heads import module_path
from .report import collective_calls, human_bytes
from ..annotations import annotation

UNGROUPED = "(graph)"  # the block of a collective that no module of the model owns
STYLE_FAMILIES = ("colwise", "rowwise", "replicate", "other")
COLOURS = {"colwise": "#4e79a7", "rowwise": "#f28e2b", "replicate": "#bab0ac", "other": "#b07aa1",
           "parameters": "#59a14f", "activations": "#edc948", "compute": "#4e79a7",
           "exposed": "#e15759", "overlapped": "#76b7b2"}
TIME_KEYS = ("compute_s", "comm_s", "exposed_comm_s")


# --- the numbers -----------------------------------------------------------------------------------------------

def block_of(path: str) -> str:
    """The repeated block a module belongs to: its path up to the first numeric component
    ("transformer_blocks.3.attn.to_q" -> "transformer_blocks.3"); a module outside any numbered list is grouped
    under its top-level module ("time_embedder.linear_1" -> "time_embedder")."""
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return parts[0]


def _within(block: str, path: str) -> str:
    """The path inside its block, or the whole path for a block that is the module itself ("proj_out")."""
    return path[len(block) + 1:] or path


def _owning_block(node) -> str:
    """A collective's block: its own module's, else that of the nearest value it reads from that has one (inserted
    collectives often carry no module stack of their own), else ``UNGROUPED``."""
    queue, seen = deque([node]), {node}
    while queue:
        current = queue.popleft()
        path = module_path(current)
        if path:
            return block_of(path)
        for source in current.all_input_nodes:
            if source not in seen:
                seen.add(source)
                queue.append(source)
    return UNGROUPED


def _block_collectives(graph_module) -> dict[str, dict[tuple[str, str, int], int]]:
    """block -> (kind, axis, bytes per call) -> calls, sized by the report's own ``collective_calls``."""
    blocks: dict[str, dict[tuple[str, str, int], int]] = {}
    for node in graph_module.graph.nodes:
        if annotation(node).collective is None:
            continue
        kind, axis = annotation(node).collective
        size, count = collective_calls(node)
        calls = blocks.setdefault(_owning_block(node), {})
        calls[(kind, axis, size)] = calls.get((kind, axis, size), 0) + count
    return blocks


def _check_times(times: dict | None) -> dict | None:
    if times is None:
        return None
    missing = [key for key in TIME_KEYS if key not in times]
    if missing:
        raise InputError(f"times needs {list(TIME_KEYS)} (seconds per step), missing {missing}: pass e.g. "
                         "{'compute_s': 0.8, 'comm_s': 0.3, 'exposed_comm_s': 0.1}")
    return {key: float(times[key]) for key in TIME_KEYS}


def plan_summary(partitioned, times: dict | None = None) -> dict:
    """The plan as a JSON-able dict: every block with its Linears' styles and its collectives, every rank's memory,
    totals for this rank, and ``times`` ({"compute_s", "comm_s", "exposed_comm_s"}: the caller's estimate of one
    step, e.g. the planner's cost model) or None.

    Blocks are in the order their Linears were planned (graph order); blocks holding only collectives follow.
    Collective bytes are this rank's (``partitioned.mesh.rank``), counted as ``Report.collectives`` counts them, so
    the blocks' ``collective_bytes`` sum to the report's bytes per step. Each rank's parameters are its own (uneven
    splits differ); its ``activation_bytes`` is this rank's activation peak estimate, given for every rank (the
    ranks run the same program on equal or near-equal shards)."""
    report = partitioned.report()
    blocks: dict[str, dict] = {}

    def block(name: str) -> dict:
        return blocks.setdefault(name, {"name": name, "linears": [], "collectives": [], "collective_bytes": 0})

    for path, decided in partitioned.linear_decisions.items():
        name = block_of(path)
        block(name)["linears"].append({"path": _within(name, path), "style": str(decided),
                                       "family": decided.style.value})
    for name, calls in _block_collectives(partitioned.graph_module).items():
        entry = block(name)
        entry["collectives"] = [{"kind": kind, "axis": axis, "count": count, "bytes_per_call": size}
                                for (kind, axis, size), count in sorted(calls.items())]
        entry["collective_bytes"] = sum(c["count"] * c["bytes_per_call"] for c in entry["collectives"])
    ranks = [{"rank": rank, "parameter_count": count, "parameter_bytes": size,
              "activation_bytes": report.activation_peak_bytes}
             for rank, (count, size) in enumerate(report.rank_parameters)]
    return {"model": partitioned.model_name, "mesh": partitioned.mesh.sizes, "rank": partitioned.mesh.rank,
            "blocks": list(blocks.values()), "ranks": ranks,
            "totals": {"parameter_bytes": report.total_parameter_bytes,
                       "collective_bytes": sum(c.count * c.bytes_per_call for c in report.collectives),
                       "linears": len(partitioned.linear_styles)},
            "times": _check_times(times)}


# --- the page --------------------------------------------------------------------------------------------------

_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table.plan { border-collapse: collapse; }
table.plan th, table.plan td { border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; }
table.plan th[scope=row] { text-align: left; white-space: nowrap; font-weight: 600; }
td.linear { color: #fff; font-size: 11px; white-space: nowrap; }
td.linear.replicate { color: #222; }
td.collectives { font-size: 11px; white-space: nowrap; }
td.bytes { text-align: right; white-space: nowrap; }
.swatch { display: inline-block; width: 1em; height: 1em; vertical-align: middle; margin: 0 4px 0 12px; }
.bars { display: grid; grid-template-columns: max-content 1fr max-content; gap: 3px 8px; align-items: center;
        max-width: 900px; }
.bar { display: flex; height: 14px; background: #f4f4f4; }
.bar span { display: block; height: 100%; }
""" + "".join(f".{name} {{ background: {colour}; }}\n" for name, colour in COLOURS.items())


def _e(value) -> str:
    return html.escape(str(value))


def _legend(names: list[tuple[str, str]]) -> str:
    return "<p>" + "".join(f'<span class="swatch {cls}"></span>{_e(label)}' for cls, label in names) + "</p>"


def _linear_cell(block: str, linear: dict) -> str:
    full = linear["path"] if linear["path"] == block else f"{block}.{linear['path']}"
    family = linear["family"] if linear["family"] in STYLE_FAMILIES else "other"
    return (f'<td class="linear {family}" title="{_e(full)}: {_e(linear["style"])}">{_e(linear["path"])}</td>')


def _collectives_text(block: dict) -> str:
    return "<br>".join(f'{_e(c["kind"])}[{_e(c["axis"])}] &times;{c["count"]} &middot; '
                       f'{_e(human_bytes(c["bytes_per_call"]))} each' for c in block["collectives"])


def _blocks_table(summary: dict) -> str:
    width = max((len(block["linears"]) for block in summary["blocks"]), default=0)
    header = (f'<tr><th>block</th><th colspan="{max(width, 1)}">linears</th><th>collectives</th>'
              "<th>bytes / step</th></tr>")
    rows = []
    for block in summary["blocks"]:
        cells = [_linear_cell(block["name"], linear) for linear in block["linears"]]
        spare = max(width, 1) - len(cells)  # pad short rows so the collectives stay one column
        if spare:
            cells.append(f'<td colspan="{spare}"></td>')
        rows.append(f'<tr data-block="{_e(block["name"])}"><th scope="row">{_e(block["name"])}</th>{"".join(cells)}'
                    f'<td class="collectives">{_collectives_text(block)}</td>'
                    f'<td class="bytes">{_e(human_bytes(block["collective_bytes"]))}</td></tr>')
    legend = _legend([(family, family) for family in STYLE_FAMILIES])
    return f'{legend}<table class="plan">{header}{"".join(rows)}</table>'


def _segments(parts: list[tuple[str, float, str]], whole: float) -> str:
    """Bar segments (class, value, tooltip) as percentages of ``whole``."""
    return "".join(f'<span class="{cls}" style="width:{100 * value / whole:.3f}%" title="{_e(tip)}"></span>'
                   for cls, value, tip in parts if whole > 0 and value > 0)


def _memory_bars(summary: dict) -> str:
    largest = max((r["parameter_bytes"] + r["activation_bytes"] for r in summary["ranks"]), default=0)
    rows = []
    for r in summary["ranks"]:
        total = r["parameter_bytes"] + r["activation_bytes"]
        bar = _segments([("parameters", r["parameter_bytes"], f"parameters {human_bytes(r['parameter_bytes'])}"),
                         ("activations", r["activation_bytes"], f"activations {human_bytes(r['activation_bytes'])}")],
                        largest)
        rows.append(f'<span>rank {r["rank"]}</span><div class="bar" data-rank="{r["rank"]}">{bar}</div>'
                    f'<span>{_e(human_bytes(total))}</span>')
    legend = _legend([("parameters", "parameters"), ("activations", "activation peak (estimate)")])
    return f'{legend}<div class="bars">{"".join(rows)}</div>'


def _time_bars(times: dict) -> str:
    """Two bars on one scale, the step (compute, then exposed communication) and the communication under it: the
    overlapped part hidden under compute, the exposed part after it."""
    compute, comm, exposed = (times[key] for key in TIME_KEYS)
    overlapped = min(max(comm - exposed, 0.0), compute)
    step = compute + exposed
    ms = lambda seconds: f"{seconds * 1e3:.3g} ms"  # noqa: E731
    step_bar = _segments([("compute", compute, f"compute {ms(compute)}"),
                          ("exposed", exposed, f"exposed communication {ms(exposed)}")], step)
    comm_bar = (f'<span style="width:{100 * (compute - overlapped) / step:.3f}%"></span>' if step > 0 else "") + \
        _segments([("overlapped", overlapped, f"overlapped communication {ms(overlapped)}"),
                   ("exposed", exposed, f"exposed communication {ms(exposed)}")], step)
    legend = _legend([("compute", "compute"), ("exposed", "exposed communication"),
                      ("overlapped", "overlapped communication (hidden under compute)")])
    return (f'{legend}<div class="bars"><span>step</span><div class="bar">{step_bar}</div><span>{ms(step)}</span>'
            f'<span>communication</span><div class="bar">{comm_bar}</div><span>{ms(comm)}</span></div>')


def _embedded(summary: dict) -> str:
    """The summary as script data: entities are not decoded inside <script>, so "<", ">" and "&" are written as
    JSON escapes instead (no "</script>" can end it early), which json.loads reads back unchanged."""
    text = json.dumps(summary, sort_keys=True)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_html(summary: dict) -> str:
    """One self-contained HTML document drawing ``plan_summary``'s dict, with the dict embedded as JSON."""
    totals = summary["totals"]
    mesh = " x ".join(f"{axis}={size}" for axis, size in summary["mesh"].items())
    title = f"{summary['model']} on {mesh}"
    times = f"<h2>Step time (estimate)</h2>{_time_bars(summary['times'])}" if summary.get("times") else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{_e(title)}</h1>
<p>Rank {_e(summary['rank'])}: {totals['linears']} linears, parameters {_e(human_bytes(totals['parameter_bytes']))},
collectives {_e(human_bytes(totals['collective_bytes']))} per step.</p>
<h2>Blocks</h2>
{_blocks_table(summary)}
<h2>Memory per rank</h2>
{_memory_bars(summary)}
{times}
<script type="application/json" id="plan-data">{_embedded(summary)}</script>
</body></html>
"""


def write_html(partitioned, path, times: dict | None = None) -> Path:
    """Write the plan's page to ``path``; ``times`` as for ``plan_summary``."""
    path = Path(path)
    path.write_text(render_html(plan_summary(partitioned, times)), encoding="utf-8")
    return path
