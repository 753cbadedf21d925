"""hoist_host: move data-dependent ops into a CPU prologue and give the device graph static shapes.

Requires: an exported graph (``meta["val"]`` on every node; data-dependent sizes are unbacked symbols, ``u0``).
Guarantees:
- every op whose output size depends on tensor contents (``torch.unique``, ``nonzero``, ``masked_select``,
  ``.item()``, ``repeat_interleave`` with tensor repeats: whatever export gives an unbacked size), with the values
  only it consumes and the checks on its sizes, runs in ``ctx.host.prologue``, a graph executed on the CPU;
- its results reach the device graph as placeholders of kind "host" (explicit transfers), padded along each
  data-dependent dim to that size's upper bound; the padding is zeros and, for ``unique``'s distinct values, no
  per-row index points at it, so results do not change;
- the device graph carries no unbacked symbol: its values are re-propagated with the bounded, static shapes.
Numbers read from tensors the forward builds from constants alone (a router's fixed per-expert capacity, read back
by ``.tolist()``) are computed at partition time and written into the graph instead, when that leaves no
data-dependent size (``_fold_constant_numbers``).
Bounds come from ``torch._check(n <= k)`` in the traced code (export records them) or from the ``bounds`` option
of ``partition``, keyed by the data-dependent op's node name (the error for a missing bound names it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..decisions import Hoisted, HostKind
from ..errors import DataDependentNumber, InvariantError
from ..kinds import InputKind
from ..frontend.padding import follow_padding
from ..frontend.trace import GraphInput, copy_graph_module
from ..source import source_line
from ..rules import PartitionError
from .context import PassContext
from .plan_sequence import ancestors
from .regions import propagate_fake_values

# Trace-time checks on sizes: true by construction once shapes are static and bounded.
_SIZE_CHECKS = {torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
                torch.ops.aten.sym_constrain_range.default}


@dataclass(frozen=True)
class Transfer:
    """A prologue output the device graph reads, padded along ``dims`` (dim -> symbolic size) to ``shape``."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sizes: dict[int, str]  # dim -> its data-dependent size expression, e.g. {0: "u0"}


@dataclass
class HostProgram:
    prologue: GraphModule  # takes the forward's flattened arguments listed in ``inputs``, returns the transfers
    inputs: list[int]  # indices into the flattened forward arguments
    transfers: list[Transfer]
    hoisted: dict[str, Hoisted] = field(default_factory=dict)  # node -> why it runs on the host
    # graph outputs whose size is data-dependent, trimmed after the device graph: (output index, dim, size)
    trims: list[tuple[int, int, str]] = field(default_factory=list)

    def sizes(self, transfers: list[torch.Tensor]) -> dict[str, int]:
        """The data-dependent sizes of this call (symbol -> value), read off the unpadded transfers."""
        values = {}
        for value, transfer in zip(transfers, self.transfers):
            for dim, expression in transfer.sizes.items():
                if expression.isidentifier():
                    values[expression] = value.shape[dim]
        return values


def _unbacked(val) -> set:
    if isinstance(val, (tuple, list)):
        return set().union(*map(_unbacked, val)) if val else set()
    if isinstance(val, (torch.Tensor, torch.SymInt, torch.SymBool)):
        return set(free_unbacked_symbols(val))
    return set()


def _sources(gm: GraphModule) -> list[Node]:
    """Ops that create a data-dependent size (their output has an unbacked symbol none of their inputs has)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            created = _unbacked(node.meta.get("val")) - set().union(*(_unbacked(n.meta.get("val"))
                                                                      for n in node.all_input_nodes))
            if created:
                found.append(node)
    return found


def _refuse_device_cuts(gm: GraphModule, ctx: PassContext, sources: list[Node]) -> None:
    """A source sized by a number another source read from the forward's arguments (``y[:, :n]`` with
    ``n = mask.sum().item()``) cuts a tensor; when that tensor is computed from the model's weights the cut cannot
    run on the host, and padding it to a bound would let what follows (attention over its rows, sums) read rows
    past ``n``: refused by name. (A length computed from activations or from constants alone, a router's
    per-expert counts, is left to the prologue's own refusal.)"""
    model_inputs = {node: graph_input.target for node, graph_input in ctx.placeholder_inputs(gm).items()
                    if graph_input.kind != "user"}

    def behind(node: Node) -> list[Node]:
        """The graph's inputs ``node`` is computed from (or is), in graph order."""
        reached = ancestors([node]) | {node}
        return [n for n in gm.graph.nodes if n in reached and n.op == "placeholder"]

    for cut in sources:
        sizes = [a for a in cut.args if isinstance(a, Node) and not isinstance(a.meta.get("val"), torch.Tensor)
                 and _unbacked(a.meta.get("val"))]
        operand = next((a for a in cut.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
        length_from = behind(sizes[0]) if sizes and operand is not None else []
        if not length_from or any(n in model_inputs for n in length_from):
            continue  # (a length computed from activations, or from constants alone: the prologue's refusal)
        weights = [n for n in behind(operand) if n in model_inputs]
        if weights:
            raise DataDependentNumber(
                f"{cut.name} ({cut.target}; {source_line(cut)}) cuts {operand.name}, a value the model computes "
                f"from its weights ({model_inputs[weights[0]]}), to a length read from data ({sizes[0].name}: "
                f"{source_line(sizes[0])}); the host prologue cannot compute it, and padding it to a bound would let "
                "what follows read the rows past that length. Call the model with inputs already cut to that length "
                "(e.g. the text rows its mask keeps), so the size is static")


def _host_nodes(gm: GraphModule, sources: list[Node]) -> set[Node]:
    """The sources, what only they (transitively) consume, the unpacking of their results, the arithmetic and
    checks on their sizes, and tensors sized by them."""
    host = set(sources)
    nodes = list(gm.graph.nodes)
    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):  # producers used only by the host
            if node not in host and node.op == "call_function" and node.users and all(u in host for u in node.users):
                host.add(node)
                changed = True
        for node in nodes:  # unpacking and size arithmetic on host values
            if node in host or node.op != "call_function" or not node.all_input_nodes:
                continue
            # size arithmetic, unpacking, and tensors sized by a host number (arange(n)) stay with the host
            scalar = not isinstance(node.meta.get("val"), torch.Tensor) or node.target is operator.getitem or any(
                not isinstance(n.meta.get("val"), torch.Tensor) for n in node.all_input_nodes)
            if scalar and all(n in host for n in node.all_input_nodes):
                host.add(node)
                changed = True
    return host


def _bound(expression, traced_bounds: dict[str, int], user_bounds: dict[str, int], source: Node) -> int:
    symbols = {str(s): s for s in expression.free_symbols}
    values = {}
    for name, symbol in symbols.items():
        bound = user_bounds.get(source.name, traced_bounds.get(name))
        if bound is None:
            raise PartitionError(
                f"{source.name} ({source.target}) has a data-dependent size {name} with no upper bound; add "
                f"torch._check({name_hint(source)} <= k) after it in the model, or pass "
                f"partition(..., bounds={{'{source.name}': k}})")
        values[symbol] = bound
    return int(expression.xreplace(values))


def name_hint(source: Node) -> str:
    return "n" if source.target is not torch.ops.aten._unique2.default else "values.shape[0]"


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _build_prologue(gm: GraphModule, ctx: PassContext, host: set[Node],
                    sources: list[Node]) -> tuple[Graph, list[int], list[Node]]:
    """The host nodes, in order, over the forward arguments they read; returns the graph, those arguments' indices,
    and the host values the device reads (the transfers)."""
    prologue, env, inputs = Graph(), {}, []
    for node, graph_input in ctx.placeholder_inputs(gm).items():
        if not any(u in host for u in node.users):
            continue
        if graph_input.kind != "user":
            # (rows picked by a mask from projected text: the host cannot take it, the values the mask has can)
            raise DataDependentNumber(f"{node.name} ({graph_input.target}) is a model tensor read by data-dependent "
                                      "host code; only forward arguments can feed the host prologue")
        env[node] = prologue.placeholder(node.name)
        inputs.append(graph_input.target)
    ordered = [n for n in gm.graph.nodes if n in host]
    for node in ordered:
        computed = [n for n in node.all_input_nodes if n not in env]
        if computed:  # (a router's top-k over activations: its per-expert counts size what follows)
            made = next((n for n in ordered if n in sources), node)
            raise DataDependentNumber(
                f"{made.name} ({made.target}; {source_line(made)}) makes a data-dependent size, and the host code "
                f"around it reads {computed[0].name}, a value the device computes ({source_line(computed[0])}), at "
                f"{node.name} ({source_line(node)}); the host prologue takes only the forward's arguments. Sizes "
                "that depend on activations (a mixture-of-experts "
                "router's per-expert counts, capacity-limited dispatch) cannot be hoisted; give the model a "
                "static-size form (dense dispatch: every expert over every row, masked by its routing weight)")
        env[node] = prologue.node_copy(node, lambda n: env[n])
        device_users = [u.name for u in node.users if u not in host]
        if device_users and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
            raise DataDependentNumber(f"{node.name} ({node.target}) is a data-dependent number that device ops use "
                                      f"({', '.join(device_users)}; {source_line(node)}); compute the tensor it "
                                      "sizes on the host, or give the model a static size")
    outgoing = [n for n in ordered if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in host for u in n.users)]
    prologue.output(tuple(env[n] for n in outgoing))
    return prologue, inputs, outgoing


def _add_transfers(gm: GraphModule, ctx: PassContext, host: set[Node], outgoing: list[Node],
                   source_of: dict[str, Node]) -> list[Transfer]:
    """Device placeholders for the host values, with each data-dependent dim bounded."""
    transfers, last = [], _placeholders(gm)[-1]
    for index, node in enumerate(outgoing):
        sizes, shape = {}, []
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and free_unbacked_symbols(size):
                expression = size.node.expr
                sizes[dim] = str(expression)
                shape.append(_bound(expression, ctx.size_bounds, ctx.bounds,
                                    source_of[str(next(iter(expression.free_symbols)))]))
            else:
                shape.append(int(size))
        transfers.append(Transfer(node.name, tuple(shape), node.meta["val"].dtype, sizes))
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"host_{node.name}")
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user not in host)
        ctx.inputs.append(GraphInput(InputKind.HOST, index, persistent=False))
    return transfers


def _output_trims(gm: GraphModule) -> list[tuple[int, int, str]]:
    """Graph outputs with a data-dependent dim: (output index, dim, size expression)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [(index, dim, str(size.node.expr)) for index, value in enumerate(output.args[0])
            if isinstance(value, Node) and isinstance(value.meta.get("val"), torch.Tensor)
            for dim, size in enumerate(value.meta["val"].shape)
            if isinstance(size, torch.SymInt) and free_unbacked_symbols(size)]


def _reasons(gm: GraphModule, host: set[Node], sources: list[Node]) -> dict[str, Hoisted]:
    """Why each hoisted node runs on the host, in graph order."""
    hoisted = {n.name: Hoisted(HostKind.DATA_DEPENDENT, str(n.target)) for n in sources}
    for n in (n for n in gm.graph.nodes if n in host):
        if n not in sources and isinstance(n.meta.get("val"), torch.Tensor):
            unpacks = n.target is operator.getitem and n.args[0] in sources
            hoisted[n.name] = (Hoisted(HostKind.RESULT, str(n.target), n.args[0].name) if unpacks
                               else Hoisted(HostKind.FEEDS_HOST, str(n.target)))
    return hoisted


def _remove_from_device(gm: GraphModule, ctx: PassContext, host: set[Node], prologue_inputs: list[int]) -> None:
    """Erase the host nodes, the trace-time size checks, and forward arguments only the prologue reads."""
    for node in reversed([n for n in gm.graph.nodes if n in host]):
        gm.graph.erase_node(node)
    for node in [n for n in gm.graph.nodes if n.target in _SIZE_CHECKS]:
        gm.graph.erase_node(node)
    kept = []
    for node, graph_input in zip(_placeholders(gm), list(ctx.inputs)):
        if graph_input.kind == "user" and not node.users and graph_input.target in prologue_inputs:
            gm.graph.erase_node(node)
        else:
            kept.append(graph_input)
    ctx.inputs[:] = kept


def _propagate_static_shapes(gm: GraphModule, ctx: PassContext, transfers: list[Transfer]) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = []
        for node, graph_input in zip(_placeholders(gm), ctx.inputs):
            val = node.meta.get("val")
            if graph_input.kind == "host":
                transfer = transfers[graph_input.target]
                fakes.append(torch.empty(transfer.shape, dtype=transfer.dtype))
            elif isinstance(val, torch.Tensor):
                fakes.append(torch.empty(val.shape, dtype=val.dtype, device=val.device))
            else:
                fakes.append(val)
    propagate_fake_values(gm, mode, fakes)


def _same_every_call(node: Node) -> bool:
    """An op whose result depends only on its arguments: no graph input, no random draw, no uninitialised memory,
    nothing but aten ops and Python's arithmetic on their numbers."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded not in node.target.tags and \
            node.target.overloadpacket not in _UNINITIALISED
    return node.target.__module__ in ("_operator", "operator", "builtins", "math")


_UNINITIALISED = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                  torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}


def _evaluate_number_arithmetic(graph: Graph) -> None:
    """Python arithmetic and the trace's size checks whose arguments are all plain numbers now: computed and put
    in their users' arguments (a check is run, then dropped)."""
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.all_input_nodes or not (
                    node.target in _SIZE_CHECKS or _same_every_call(node) and not isinstance(node.target,
                                                                                        torch._ops.OpOverload)):
                continue
            _replace_with_number(node, node.target(*node.args, **node.kwargs))
            graph.erase_node(node)
            changed = True


def _replace_with_number(node: Node, value) -> None:
    """Every user of ``node`` reads the plain ``value`` in its place."""
    for user in list(node.users):
        user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda n: value if n is node else n)


def _fold_constant_numbers(gm: GraphModule, ctx: PassContext, sources: list[Node]) -> bool:
    """Numbers read from tensors the forward builds from constants alone (a router's per-expert capacity,
    ``torch.full((experts,), capacity).tolist()``) are the same on every call: computed now and written into the
    graph, whose sizes then come out static. Only where that leaves no data-dependent size at all (sizes of other
    sources keep their traced bounds, which a new propagation would not know); True when folded."""
    reads = [s for s in sources if not isinstance(s.meta.get("val"), torch.Tensor)
             and all(_same_every_call(n) for n in ancestors([s]) | {s})]
    if not reads:
        return False
    folded, env = copy_graph_module(gm), {}
    mapping = dict(zip(gm.graph.nodes, folded.graph.nodes))
    needed = ancestors(reads) | set(reads)
    try:
        for node in (n for n in gm.graph.nodes if n in needed):  # (in graph order: ancestors first)
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            if "device" in kwargs:
                kwargs = {**kwargs, "device": "cpu"}  # (a model traced on meta builds its constants there)
            env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (not computable here: the prologue's own refusal says what it is)
        return False
    for read in reads:
        _replace_with_number(mapping[read], env[read])
    try:  # arithmetic on the numbers and the trace's checks on them, now of plain numbers: computed (a check raises)
        _evaluate_number_arithmetic(folded.graph)
    except Exception:  # noqa: BLE001  (a check the numbers fail: the prologue's own refusal)
        return False
    folded.graph.eliminate_dead_code()
    for node in folded.graph.nodes:  # (the symbols export bound are gone with the reads)
        node.meta.pop("unbacked_bindings", None)
    try:
        _propagate_static_shapes(folded, ctx, [])
    except Exception:  # noqa: BLE001  (a size still read from data: left as traced)
        return False
    if _sources(folded) or any(_unbacked(n.meta.get("val")) for n in folded.graph.nodes):
        return False
    gm.graph = folded.graph
    gm.recompile()
    return True


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    sources = _sources(gm)
    if not sources or _fold_constant_numbers(gm, ctx, sources):
        return gm
    _refuse_device_cuts(gm, ctx, sources)
    host = _host_nodes(gm, sources)
    source_of = {}  # symbol -> the op that created it, for bounds and messages
    for source in sources:
        for symbol in _unbacked(source.meta["val"]):
            source_of.setdefault(str(symbol), source)
    prologue, prologue_inputs, outgoing = _build_prologue(gm, ctx, host, sources)
    transfers = _add_transfers(gm, ctx, host, outgoing, source_of)
    trims = _output_trims(gm)
    ctx.host = HostProgram(GraphModule(gm, prologue, class_name="HostPrologue"), prologue_inputs, transfers,
                           _reasons(gm, host, sources), trims)
    _remove_from_device(gm, ctx, host, prologue_inputs)
    gm.graph.lint()
    _propagate_static_shapes(gm, ctx, transfers)
    padded = {node: next(iter(transfers[gi.target].sizes)) for node, gi in zip(_placeholders(gm), ctx.inputs)
              if gi.kind == "host" and transfers[gi.target].sizes}
    follow_padding(gm, padded, {(index, dim) for index, dim, _ in trims})
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no value of the device graph has a data-dependent size."""
    for node in gm.graph.nodes:
        if _unbacked(node.meta.get("val")):
            raise InvariantError(f"{node.name} still has a data-dependent size {node.meta['val']}")
