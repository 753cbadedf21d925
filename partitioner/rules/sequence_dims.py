"""Which dim of each value carries an attention's rows, found from the graph's structure, never from sizes.

A sequence planner must know, for every value that feeds (or follows) an attention, which of its dims holds the
attention's rows: a ``[batch, rows, features]`` hidden state whose row count happens to equal its width (Flux at
1024x768: 3072 image rows, 3072 features) has two dims of the same size, and only the graph says which is which.

The rows of ``scaled_dot_product_attention(q, k, v)`` are dim 2 of q, k and v and of its output. From there the
walk follows each value to its inputs (``backward``) and, from every attention's output, to its users
(``forward``), asking the op's own sequence-axis rule (``partitioner.rules``, the semantics the planner
propagates with) which dim carries the rows: an input's dim ``e`` carries the rows of an op's dim ``d`` when the
rule, given the input sharded along ``e`` alone, places the op's output along ``d`` and takes the input as it is
(for an attention, the output's rows are its queries'). A dim of size 1 is never taken (it broadcasts). A value
reached with two different dims is ambiguous and left out.

Along the way the walk records the values that join a sequence from parts along its rows (``cat`` of text and
image rows, rows written into a buffer): the planner shards each part on its own and the joint value as a packed
shard.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from ..placement import PackedShard, Replicate, Shard, is_sharded
from . import NeedsPacking, NeedsUnit, Unshardable
from .written_attention import attention_operands, written_attention

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
_JOINS = (torch.ops.aten.cat.default, torch.ops.aten.slice_scatter.default)
R = Replicate()


@dataclass
class SequenceDims:
    dims: dict[Node, int] = field(default_factory=dict)  # value -> the dim that carries attention rows
    attentions: dict[Node, set[Node]] = field(default_factory=dict)  # value -> the attentions whose rows it feeds
    joins: set[Node] = field(default_factory=set)  # values joined from parts along their rows
    joined: set[Node] = field(default_factory=set)  # values carrying a joined sequence (a join, and on from it)
    direct: set[Node] = field(default_factory=set)  # values whose rows reach an attention through no join
    # values whose rows are some attention's query rows, or computed from such rows (keys and values of a
    # self-attention); rows that are only ever keys and values (a text every image row attends to) are not
    attended: set[Node] = field(default_factory=set)
    ambiguous: set[Node] = field(default_factory=set)  # values reached with two different row dims
    row_dims: dict[Node, set[int]] = field(default_factory=dict)  # every row dim each value was reached with

    def dim(self, node: Node) -> int | None:
        return None if node in self.ambiguous else self.dims.get(node)


def _shape(node: Node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _element(placement, index):
    if index is None:
        return placement
    return placement[index] if isinstance(placement, tuple) and index < len(placement) else R


def _probe(rule, node: Node, source: Node, dim: int, degree: int):
    """``node``'s decision given ``source`` sharded along ``dim`` and every other input whole (packed at the cuts
    the op asks for: a joint sequence split back into its parts; in the whole groups of rows it asks for: an image
    under a strided convolution); None if refused."""
    placement = Shard(dim)
    for _ in range(3):
        try:
            return rule(node, {source: placement}, degree)
        except NeedsPacking as needed:
            placement = PackedShard(dim, tuple(needed.blocks))
        except NeedsUnit as needed:
            size = _shape(source)[dim]
            if size % needed.unit or isinstance(placement, PackedShard):
                return None
            placement = PackedShard(dim, (size,), needed.unit)
        except Unshardable:
            return None
    return None


def _takes_as_is(node: Node, source: Node, dim: int, decision) -> bool:
    """The op reads ``source`` along ``dim`` where it is (an attention reads its queries' rows through its own
    exchange, which hands the output back along them)."""
    taken = decision.inputs.get(source, Shard(dim))
    return node.target is _ATTENTION or (is_sharded(taken) and taken.dim == dim)


def _is_getitem(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _row_dims(node: Node) -> list[int]:
    """The dims of a tensor value that could carry rows (size 1 broadcasts)."""
    shape = _shape(node)
    return [] if shape is None else [d for d, size in enumerate(shape) if size > 1]


def _joins_along(node: Node, dim: int) -> bool:
    """``node`` joins parts along ``dim``: a cat of several values, or rows written into a buffer there."""
    ndim = len(_shape(node))
    if node.target is torch.ops.aten.cat.default:
        along = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return len(node.args[0]) > 1 and along % ndim == dim
    along = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return along % ndim == dim


def find_sequence_dims(gm: GraphModule, rule_of: Callable[[Node], Callable],
                       skip: Callable[[Node], bool] = lambda node: False) -> SequenceDims:
    """The row dim of every value that feeds an attention's q, k or v, or follows an attention's output, under the
    rules ``rule_of(node)`` gives (a sequence axis's). Which dim holds the rows does not depend on how many ranks
    split them: the rules are asked for 2 ranks, which any dim of 2 rows or more can take. ``skip``: values the
    walk does not enter (the model's weights)."""
    degree = 2
    operands, rows = {}, {}  # attention -> (q, k, v), and the dim of their rows
    for n in gm.graph.nodes:
        found = attention_operands(n)
        ndim = len(_shape(found[0]) or ()) if found is not None else 0
        # (3-D: a written attention over batch and heads folded into one dim; a 3-D SDPA has no heads to exchange)
        if ndim == 4 or ndim == 3 and written_attention(n) is not None:
            operands[n], rows[n] = found, ndim - 2
    attentions = list(operands)
    found = SequenceDims()
    rules: dict[Node, Callable] = {}
    carries: dict[Node, list[Node]] = {}  # value -> the inputs that carry its rows (backward walk)

    def rule(node: Node):
        if node not in rules:
            rules[node] = rule_of(node)
        return rules[node]

    def record(node: Node, dim: int) -> bool:
        """Note ``node``'s row dim; True the first time it is seen."""
        known = found.dims.get(node)
        found.row_dims.setdefault(node, set()).add(dim)
        if known is not None and known != dim:
            found.ambiguous.add(node)
        if known is None:
            found.dims[node] = dim
        return known is None

    # backward: from each attention's q, k and v to what they are computed from; a multi-output op's element is
    # reached through its getitem (``index``)
    queue = deque()
    for attention in attentions:
        for source in operands[attention]:
            if isinstance(source, Node) and rows[attention] in _row_dims(source) and record(source, rows[attention]):
                queue.append((source, rows[attention], None))
    visited = set()
    while queue:
        node, dim, index = queue.popleft()
        if (node, dim, index) in visited or node.op != "call_function" or skip(node):
            continue
        visited.add((node, dim, index))
        if _is_getitem(node):
            carries.setdefault(node, []).append(node.args[0])
            queue.append((node.args[0], dim, node.args[1]))
            continue
        if index is None and node.target in _JOINS and _joins_along(node, dim):
            found.joins.add(node)
        for source in node.all_input_nodes:
            if skip(source) or isinstance(source.meta.get("val"), (tuple, list)):
                continue
            for e in _row_dims(source):
                decision = _probe(rule(node), node, source, e, degree)
                seen = None if decision is None else _element(decision.seen, index)
                if seen is not None and is_sharded(seen) and seen.dim == dim and \
                        _takes_as_is(node, source, e, decision):
                    carries.setdefault(node, []).append(source)
                    record(source, e)
                    queue.append((source, e, None))
    _reach(operands, carries, found)
    # forward: from each attention's output to what it computes
    for attention in attentions:
        # (flex_attention returns a tuple: output and logsumexp, both with rows along dim 2)
        outputs = [attention] if isinstance(attention.meta.get("val"), torch.Tensor) else \
            [getter for getter in attention.users if _is_getitem(getter)]
        for output in outputs:
            record(output, rows[attention])
            queue.append((output, rows[attention]))
    visited = set()
    while queue:
        node, dim = queue.popleft()
        if (node, dim) in visited:
            continue
        visited.add((node, dim))
        for user in node.users:
            if user.op != "call_function" or skip(user):
                continue
            decision = _probe(rule(user), user, node, dim, degree)
            if decision is None or not _takes_as_is(user, node, dim, decision):
                continue
            if isinstance(decision.seen, tuple):  # a multi-output op: its getitems carry the rows
                for getter in user.users:
                    placement = _element(decision.seen, getter.args[1]) if _is_getitem(getter) else R
                    if is_sharded(placement) and _shape(getter)[placement.dim] > 1:
                        record(getter, placement.dim)
                        queue.append((getter, placement.dim))
            elif is_sharded(decision.seen) and _shape(user)[decision.seen.dim] > 1:
                record(user, decision.seen.dim)
                queue.append((user, decision.seen.dim))
    return found


def _reach(operands: dict[Node, tuple], carries: dict[Node, list[Node]], found: SequenceDims) -> None:
    """Over the edges the backward walk found to carry rows: which attentions each value's rows feed, which values
    reach an attention through no join (``direct``), and which carry a joined sequence (``joined``)."""
    if not operands:
        return
    attentions = list(operands)
    nodes = list(attentions[0].graph.nodes)
    bit = {attention: 1 << i for i, attention in enumerate(attentions)}
    reach: dict[Node, int] = {}
    for attention in attentions:
        for source in operands[attention]:
            if isinstance(source, Node):
                reach[source] = reach.get(source, 0) | bit[attention]
                found.direct.add(source)
    queries = {q for q, _, _ in operands.values() if isinstance(q, Node)}
    for node in reversed(nodes):
        for source in carries.get(node, ()):
            reach[source] = reach.get(source, 0) | reach.get(node, 0)
            if node in found.direct and node not in found.joins:
                found.direct.add(source)
            if node in queries:
                queries.add(source)
    for node in nodes:
        sources = carries.get(node, ())
        if node in found.joins or any(source in found.joined for source in sources):
            found.joined.add(node)
        if node in queries or any(source in found.attended for source in sources):
            found.attended.add(node)
    found.attentions = {node: {a for a, b in bit.items() if mask & b} for node, mask in reach.items()}
    found.direct &= set(found.dims)
    found.attended &= set(found.dims)
