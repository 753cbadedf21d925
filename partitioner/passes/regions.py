"""Repeated blocks of a graph: the unit Inductor compiles once and reuses, and that the scheduler never reorders
nodes across (a node moved into another block's run would cut that block's region in two)."""

from __future__ import annotations

import re

from torch.fx import Node

_BLOCK = re.compile(r"\.\d+$")


def repeated_block(node: Node) -> str | None:
    """The outermost repeated block (a ModuleList child, ``transformer_blocks.7``) a node belongs to, if any."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if _BLOCK.search(path):
            return path
    return None


def runs_of_blocks(nodes) -> list[list[Node]]:
    """Consecutive runs of nodes of one repeated block (or of no block), placeholders and the output left out."""
    runs, key = [], object()
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        block = repeated_block(node)
        if block != key or not runs:
            runs.append([])
            key = block
        runs[-1].append(node)
    return runs
