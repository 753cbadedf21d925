"""matmul_as_linear: a matrix product by a weight (a value computed from the model's tensors alone) is a Linear, and
is rewritten as one, so that every rule for Linears applies to it (column or row sharding over tp, packed and
uneven splits, the planner's choice of regions). A quantised Linear traces so: torchao's int8 weight-only Linear
flattens its input, multiplies by the cast payload, scales each output column and unflattens::

    view(mm(view(x, [-1, K]), to(t(qdata))) * scale, [*lead, N])
    # is, value for value (the same matrix product: linear(x, W) computes x @ W.t()):
    linear(x, t(to(t(qdata)))) * scale

and its float8 weight-only Linear is ``matmul(x, to(to(t(qdata)) * t(scale)))``, a weight dequantised from its
parts. The weight expression stays in the graph, computed on every rank from the parts it holds: ``plan_sharding``
places the parts through it, so they are cut when they are loaded (a weight expression nothing reads is dropped:
it would keep its parts whole). Requires: nothing. Guarantees: no ``mm`` or ``matmul`` of a value by a 2-D weight
expression is left.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..rules import shape_of
from .context import PassContext
from .pointwise_convs import new_node

aten = torch.ops.aten
_PRODUCTS = (aten.mm.default, aten.matmul.default)
_FLATTENS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def weight_expressions(gm: GraphModule, ctx: PassContext) -> set[Node]:
    """Nodes computed from the model's tensors (parameters, buffers, constants) alone: the same on every call."""
    found = {node for node, graph_input in ctx.placeholder_inputs(gm).items() if graph_input.is_model_tensor}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and set(node.all_input_nodes) <= found:
            found.add(node)
    return found


def is_product_by_weight(node: Node, weights: set[Node]) -> bool:
    if node.target not in _PRODUCTS or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    return b in weights and a not in weights and len(shape_of(b) or ()) == 2 and len(shape_of(a) or ()) >= 2


def _unflattened(product: Node) -> tuple[Node, list[Node], Node] | None:
    """For ``mm(view(x, [-1, K]), W)`` whose only path on is elementwise by per-column or scalar operands and ends in
    a view back to ``[*x.shape[:-1], N]``: (x, the elementwise ops, that view). None otherwise."""
    flat = product.args[0]
    if flat.target not in _FLATTENS or len(flat.users) != 1:
        return None
    x = flat.args[0]
    lead = shape_of(x)[:-1]
    if not lead or len(lead) < 2 or shape_of(x)[-1] != shape_of(flat)[1] or math.prod(lead) != shape_of(flat)[0]:
        return None
    chain, value = [], product
    while len(value.users) == 1:
        user = next(iter(value.users))
        if user.target in _FLATTENS and shape_of(user) == (*lead, shape_of(product)[1]):
            return x, chain, user
        if not _columnwise(user, value):
            return None
        chain.append(user)
        value = user
    return None


def _columnwise(node: Node, value: Node) -> bool:
    """An elementwise op on ``value`` whose other operands are scalars or vectors over its columns."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags) or node.kwargs:
        return False
    if shape_of(node) != shape_of(value) or sum(arg is value for arg in node.args) != 1:
        return False
    return all(len(shape_of(other) or ()) <= 1 for other in node.all_input_nodes if other is not value)


def _rewrite(graph, product: Node) -> None:
    a, b = product.args
    unflattened = _unflattened(product) if product.target is aten.mm.default else None
    x = unflattened[0] if unflattened else a
    with graph.inserting_before(product):
        weight = new_node(graph, aten.t.default, (b,), product, b.meta["val"].t())
        linear = new_node(graph, aten.linear.default, (x, weight), product,
                          torch.nn.functional.linear(x.meta["val"], weight.meta["val"]))
    if unflattened is None:
        if shape_of(linear) == shape_of(product):
            product.replace_all_uses_with(linear)
        else:  # mm of a flattened input whose result is used flat: the linear's rows flattened alike
            with graph.inserting_before(product):
                flat = new_node(graph, aten.reshape.default, (linear, list(shape_of(product))), product,
                                linear.meta["val"].reshape(shape_of(product)))
            product.replace_all_uses_with(flat)
        graph.erase_node(product)
        return
    _, chain, view = unflattened
    value, previous = linear, product
    for op in chain:  # the same elementwise ops, on the unflattened rows (their operands broadcast alike)
        args = tuple(value if arg is previous else arg for arg in op.args)
        with graph.inserting_before(op):
            made = new_node(graph, op.target, args, op,
                            op.target(*(a.meta["val"] if isinstance(a, Node) else a for a in args)))
        value, previous = made, op
    view.replace_all_uses_with(value)
    for node in [view, *reversed(chain), product, product.args[0]]:
        graph.erase_node(node)


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    weights = weight_expressions(gm, ctx)
    for product in [n for n in gm.graph.nodes if is_product_by_weight(n, weights)]:
        _rewrite(gm.graph, product)
    for node in reversed(list(gm.graph.nodes)):  # weights computed and never read: they would pin their parts whole
        if node in weights and node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no matrix product by a weight expression is left."""
    weights = weight_expressions(gm, ctx)
    for node in gm.graph.nodes:
        if is_product_by_weight(node, weights):
            raise InvariantError(f"{node.name}: a matrix product by a weight was not rewritten as a linear")
