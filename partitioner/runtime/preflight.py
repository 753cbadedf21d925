"""Preflight: the index checks a call passes before its first collective.

An index out of range fails inside the graph, on the one rank that holds the bad row (under sequence parallelism
the rows are split), while its peers go on into the next collective and pair with the wrong messages. So every
index into a static dimension that is computed from the call's inputs alone (token tags, row indices, timestep
indices: integer arithmetic, views and slices of inputs) is computed once more, before the device graph, from the
whole inputs on the host, and checked against the size of the dimension it indexes. Ranks then agree on the result
(``agreement.CallGuard``), so a bad index is an ``InputError`` on every rank and the partition stays usable.

The preflight program is cut from the global planned graph: the integer-valued nodes whose inputs are call inputs
(user arguments, host-prologue transfers) or other such nodes. An index computed from model weights or from
floating-point values is not checked here (none of the models we know does that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import InputError
from ..frontend.trace import GraphInput
from ..source import source_line

aten = torch.ops.aten

# op -> (position of the index operand, position of the indexed dim or None for a list of indices, lowest valid
# index as a multiple of -size: 0 means [0, size), 1 means [-size, size))
_DIM_INDEX = {aten.index_select.default: 0, aten.index_copy.default: 0, aten.index_add.default: 0,
              aten.gather.default: 0, aten.scatter.src: 0, aten.scatter.value: 0, aten.scatter_add.default: 0}
_LIST_INDEX = {aten.index.Tensor, aten.index_put.default}


@dataclass(frozen=True)
class IndexCheck:
    """One index operand: output ``position`` of the preflight program indexes a dim of ``size``."""
    position: int
    size: int
    allow_negative: bool
    where: str  # the indexing node, its dim and the model line, for the message
    inputs: tuple[str, ...]  # the call inputs the index derives from
    # the indexed dim carries an input padded to a bucket: (flat argument index, its dim, padded size); only the
    # real rows, ``size * real // padded`` of them, may be picked
    padded: tuple[int, int, int] | None = None


def _is_integer(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and not val.dtype.is_complex \
        and val.dtype is not torch.bool


def index_operands(node: Node) -> list[tuple[Node, int, bool, str]]:
    """(index node, size of the dim it indexes, negative allowed, dim description) for each index ``node`` reads."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node) \
            or not isinstance(node.args[0].meta.get("val"), torch.Tensor):
        return []
    shape = node.args[0].meta["val"].shape
    if node.target is aten.embedding.default:
        return [(node.args[1], int(shape[0]), False, "dim 0")]
    if node.target in _DIM_INDEX:
        dim = node.args[1] % len(shape)
        return [(node.args[2], int(shape[dim]), False, f"dim {dim}")]
    if node.target in _LIST_INDEX:
        indices = node.args[1]
        if any(isinstance(i, Node) and i.meta["val"].dtype == torch.bool for i in indices):
            return []  # a mask shifts the dims the later indices address
        return [(index, int(shape[dim]), True, f"dim {dim}") for dim, index in enumerate(indices)
                if isinstance(index, Node)]
    return []


class Preflight:
    """``check(flat_args, host_transfers)`` raises ``InputError`` for the first index out of range."""

    def __init__(self, planned: GraphModule, inputs: list[GraphInput], input_names: list[str],
                 padding_reads: dict[str, tuple[int, int, int]] | None = None):
        placeholders = dict(zip([n for n in planned.graph.nodes if n.op == "placeholder"], inputs))
        computable = computable_from_call(planned, inputs, input_names)
        padding_reads = padding_reads or {}
        checked: list[tuple[Node, int, bool, str, tuple | None]] = []
        for node in planned.graph.nodes:
            for index, size, negative, dim in index_operands(node):
                if index in computable and computable[index]:
                    padded = padding_reads.get(node.name)  # (input, dim, padded size): the limit is the real rows
                    checked.append((index, size, negative and padded is None,
                                    f"{node.name} ({dim} of size {size}; {source_line(node)})", padded))
        self.checks: list[IndexCheck] = []
        self.program = None
        if not checked:
            return
        graph, env = Graph(), {}
        self.placeholders: list[GraphInput] = []
        needed = _ancestors([index for index, *_ in checked], computable)
        for node in planned.graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                env[node] = graph.placeholder(node.name)
                self.placeholders.append(placeholders[node])
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
                if isinstance(env[node].kwargs.get("device"), torch.device):
                    env[node].update_kwarg("device", torch.device("cpu"))
        outputs = []
        for position, (index, size, negative, where, padded) in enumerate(checked):
            outputs.append(env[index])
            self.checks.append(IndexCheck(position, size, negative, where, computable[index], padded))
        graph.output(outputs)
        self.program = GraphModule(torch.nn.Module(), graph)

    def check(self, flat: list, hosted: list[torch.Tensor], real_sizes: dict[int, dict[int, int]] | None = None
              ) -> None:
        """``real_sizes``: flat argument index -> {dim: size before padding to its bucket}."""
        if self.program is None:
            return
        values = [flat[gi.target] if gi.kind == "user" else hosted[gi.target] for gi in self.placeholders]
        indices = self.program(*(v.cpu() for v in values))
        for check, index in zip(self.checks, indices):
            if index.numel() == 0:
                continue
            low, high = (-check.size if check.allow_negative else 0), check.size
            if check.padded is not None:
                argument, dim, padded = check.padded
                high = check.size // padded * (real_sizes or {}).get(argument, {}).get(dim, padded)
            bad = (index < low) | (index >= high)
            if bool(bad.any()):
                position = tuple(int(p) for p in bad.nonzero()[0])
                padding = " (the rest is padding to a bucket)" if high < check.size else ""
                raise InputError(
                    f"index out of range: {index[position].item()} at position {list(position)} of a value computed "
                    f"from {', '.join(check.inputs)} indexes {check.where}; valid indices are in [{low}, {high})"
                    f"{padding}: fix the input")


def computable_from_call(graph: GraphModule, inputs: list[GraphInput], input_names: list[str]
                         ) -> dict[Node, tuple[str, ...]]:
    """The integer values computed from the call's inputs alone (user arguments, host transfers) -> the inputs
    each derives from."""
    computable: dict[Node, tuple[str, ...]] = {}
    for node, graph_input in zip([n for n in graph.graph.nodes if n.op == "placeholder"], inputs):
        if graph_input.kind in ("user", "host") and _is_integer(node):
            computable[node] = (input_names[graph_input.target] if graph_input.kind == "user"
                                else f"host {node.name}",)
    for node in graph.graph.nodes:
        if node.op == "call_function" and _is_integer(node) and all(n in computable for n in node.all_input_nodes):
            computable[node] = tuple(sorted(set().union(*(computable[n] for n in node.all_input_nodes)))) \
                if node.all_input_nodes else ()
    return computable


def _ancestors(nodes: list[Node], computable: dict) -> set[Node]:
    """``nodes`` and everything in the computable set they are computed from."""
    stack, seen = list(nodes), set()
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(n for n in current.all_input_nodes if n in computable)
    return seen
