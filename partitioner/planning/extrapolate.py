"""Costing a layout without partitioning every block: a trace cut to two and three of its repeated blocks.

A diffusion transformer is a chain of identical blocks (H3: 50 of 91 nodes each, in 5400). Partitioning the whole
graph for every layout of a search repeats the same decisions 50 times over. Instead the chain with the most nodes
is cut to its first two blocks and to its first three (``cut_chain``), both cuts are partitioned and costed, and the
whole follows from their difference: ``f(n) = f(2) + (n - 2) x (f(3) - f(2))`` for what adds up over the blocks
(FLOPs, compute, communication, parameters, collective bytes), the larger of the two for the activation peak.

That is exact when the third block is partitioned and costed as every later one is: the same code, the same
placements on entry, and the link's backlog of communication in its steady state. The first block is not (it
enters from the glue: cuts to one and two blocks were off by up to 0.7% of the step where communication
backs up); ``tests/test_planner.py`` checks the cuts against whole partitions at every layout of a small model, and
``benchmarks/partition_time.py`` against full-size H3.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from ..frontend.trace import Traced, copy_graph_module
from ..passes.regions import code_of, repeated_block, runs_of_blocks
from .report import parameter_extremes

_INDEX = re.compile(r"\.\d+$")
KEPT = 2  # blocks of the smaller cut: the first enters from the glue, the second and later are alike


@dataclass(frozen=True)
class Chain:
    """Consecutive runs of a graph's nodes, each one block of the same ModuleList with the same code."""
    module_list: str  # e.g. "transformer_blocks"
    runs: list[list[Node]]

    @property
    def blocks(self) -> int:
        return len(self.runs)


def longest_chain(gm: GraphModule) -> Chain | None:
    """The chain of identical repeated blocks with the most nodes (None where no block repeats)."""
    best: Chain | None = None
    current: list[list[Node]] = []
    code = owner = None
    for run in [*runs_of_blocks(gm.graph.nodes), []]:
        block = repeated_block(run[0]) if run else None
        run_code = code_of(run)[0] if block is not None else None
        same = block is not None and _INDEX.sub("", block) == owner and run_code == code
        if not same:
            if len(current) > 1 and (best is None or sum(map(len, current)) > sum(map(len, best.runs))):
                best = Chain(owner, current)
            current, owner, code = [], (_INDEX.sub("", block) if block is not None else None), run_code
        if block is not None:
            current.append(run)
    return best


def cut_chain(traced: Traced, keep: int) -> tuple[Traced, int] | None:
    """A copy of ``traced`` whose longest chain keeps its first ``keep`` blocks, and the chain's block count: what
    read the last block's values reads the kept last block's (the same node by position: the blocks' code is the
    same), the model tensors only the dropped blocks read are dropped with them. None where there is no chain longer
    than ``keep`` or a dropped block's value is read outside the chain other than the last's (then the cut would not
    be the model's)."""
    gm = copy_graph_module(traced.graph_module)
    chain = longest_chain(gm)
    if chain is None or chain.blocks <= keep:
        return None
    in_chain = {node for run in chain.runs for node in run}
    last, kept_last = chain.runs[-1], chain.runs[keep - 1]
    dropped, in_last = [node for run in chain.runs[keep:] for node in run], set(last)
    if any(user not in in_chain for node in dropped if node not in in_last for user in node.users):
        return None
    for node, replacement in zip(last, kept_last):
        node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user not in in_chain)
    read_by_dropped = {arg for node in dropped for arg in node.all_input_nodes if arg.op == "placeholder"}
    for node in reversed(dropped):
        gm.graph.erase_node(node)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    unread = {node for node in read_by_dropped if not node.users}
    inputs = [gi for node, gi in zip(placeholders, traced.inputs) if node not in unread]
    for node in unread:
        gm.graph.erase_node(node)
    gm.recompile()
    names = {gi.target for gi in inputs if gi.is_model_tensor}
    cut = dataclasses.replace(traced, graph_module=gm, inputs=inputs,
                              state={name: t for name, t in traced.state.items() if name in names})
    return cut, chain.blocks


def extrapolated(one, two, blocks: int, kept: int = KEPT):
    """The ``LayoutEstimate`` of ``blocks`` blocks from those of the cuts to ``kept`` and ``kept + 1`` blocks
    (``one``, ``two``): what adds up over blocks grows by the last kept block's share, the activation peak is the
    larger of the two."""
    if one.error or two.error:
        return one if one.error else two
    grow = blocks - kept

    def linear(a, b):
        if isinstance(a, dict):
            return {key: linear(a.get(key, 0), b.get(key, 0)) for key in {*a, *b}}
        if isinstance(a, list):
            return [linear(x, y) for x, y in zip(a, b)]
        return a + grow * (b - a)

    result = dataclasses.replace(
        two, flops=linear(one.flops, two.flops), compute_s=linear(one.compute_s, two.compute_s),
        comm_s=linear(one.comm_s, two.comm_s), exposed_comm_s=linear(one.exposed_comm_s, two.exposed_comm_s),
        comm_s_by_kind=linear(one.comm_s_by_kind, two.comm_s_by_kind),
        collective_bytes=linear(one.collective_bytes, two.collective_bytes),
        parameter_bytes=linear(one.parameter_bytes, two.parameter_bytes),
        parameter_count=linear(one.parameter_count, two.parameter_count),
        activation_bytes=max(one.activation_bytes, two.activation_bytes),
        ranks=[{"rank": a["rank"], **{k: linear(a[k], b[k]) for k in ("parameter_count", "parameter_bytes")}}
               for a, b in zip(one.ranks, two.ranks)],
        extrapolated_from=blocks)
    result.parameter_ranks = parameter_extremes([(r["parameter_count"], r["parameter_bytes"]) for r in result.ranks])
    return result
