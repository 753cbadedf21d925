"""Pass-by-pass dumps: the graph as readable code with placements, a summary, and a diff against the pass before.

One folder per rank (``DIR/rank<N>``: rank programs differ), its files numbered in pass order (``00_export`` is the
traced graph); the text is stable between runs (no addresses, no times), so ``diff -r`` between two runs or two
ranks shows only real differences:
    index.txt           the passes in order, with each graph's node count and collectives
    NN_<pass>.py        the graph's code; each line ends with ``# tp=S(2)``-style placements where planned
    NN_<pass>.txt       node count, collectives by kind, per-rank parameter bytes
    NN_<pass>.diff      unified diff of the code against the previous pass
    NN_hoist_host.prologue.py   the host (CPU) prologue, when the model has data-dependent ops
    NN_neuron_legalize.*  the graph Neuron's checks see (partition(..., backend_checks="neuron"))
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path

from torch.fx import GraphModule

from ..passes.context import PassContext
from ..placement import shorthand
from .report import build_report
from ..annotations import annotation

_ASSIGNMENT = re.compile(r"^\s+(\w+)(?:: \"[^\"]*\")? = ")


def _placement_comment(node) -> str:
    placements = annotation(node).placements
    if not placements:
        return ""
    parts = []
    for axis, placement in placements.items():
        text = "(" + ", ".join(map(shorthand, placement)) + ")" if isinstance(placement, tuple) else shorthand(placement)
        parts.append(f"{axis}={text}")
    return "  # " + " ".join(parts)


def graph_code(gm: GraphModule) -> str:
    """The graph as Python with shapes (per rank after localize) and each value's placements."""
    nodes = {node.name: node for node in gm.graph.nodes}
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    lines = []
    for line in code.splitlines():
        match = _ASSIGNMENT.match(line)
        lines.append(line + _placement_comment(nodes[match.group(1)]) if match and match.group(1) in nodes else line)
    return "\n".join(lines) + "\n"


def summary(gm: GraphModule, ctx: PassContext) -> str:
    report = build_report(gm, ctx)
    ops = Counter(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
    collectives = Counter()
    for c in report.collectives:
        collectives[f"{c.kind}[{c.axis}]"] += c.count
    lines = [f"nodes: {len(gm.graph.nodes)}",
             "collectives: " + (", ".join(f"{kind} x{n}" for kind, n in sorted(collectives.items())) or "none"),
             f"parameter bytes per rank: {report.total_parameter_bytes} "
             f"({', '.join(f'{k}={v}' for k, v in sorted(report.parameter_bytes.items()))})",
             "ops: " + ", ".join(f"{op} x{n}" for op, n in ops.most_common())]
    return "\n".join(lines) + "\n"


INDEX = "index.txt"


class Dumper:
    """Writes one set of files per pass into ``dump_dir/rank<rank>``; does nothing when ``dump_dir`` is None.
    ``index`` and ``previous`` continue an earlier dump (a backend's legalisation after the passes): the next files'
    number, and the graph they are diffed against."""

    def __init__(self, dump_dir: str | Path | None, rank: int, index: int = 0, previous: GraphModule | None = None):
        self.directory = Path(dump_dir) / f"rank{rank}" if dump_dir else None
        self.previous = graph_code(previous) if previous is not None and self.directory else ""
        self.index = index
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
            if index == 0:  # a new dump: no stale passes of an earlier run listed
                (self.directory / INDEX).write_text("")

    def __call__(self, name: str, gm: GraphModule, ctx: PassContext, extra: dict | None = None) -> None:
        """``extra``: further graphs of this pass (the host prologue), written as ``NN_<pass>.<key>.py``."""
        if self.directory is None:
            return
        stem = self.directory / f"{self.index:02d}_{name}"
        for key, graph in (extra or {}).items():
            (self.directory / f"{stem.name}.{key}.py").write_text(graph_code(graph))
        code, counts = graph_code(gm), summary(gm, ctx)
        stem.with_suffix(".py").write_text(code)
        stem.with_suffix(".txt").write_text(counts)
        with open(self.directory / INDEX, "a") as index:
            index.write(f"{stem.name}: " + "; ".join(counts.splitlines()[:2]) + "\n")
        if self.index:
            diff = difflib.unified_diff(self.previous.splitlines(keepends=True), code.splitlines(keepends=True),
                                        fromfile="previous", tofile=f"{self.index:02d}_{name}")
            stem.with_suffix(".diff").write_text("".join(diff))
        self.previous = code
        self.index += 1
