"""The training copy of a rank program: every collective paired with its true backward.

Built from this rank's program (after ``TO_RANK``) the first time a call records gradients; the inference program
is left as it is. Every rank computes the same loss from the same whole outputs, so a value's gradient must be what
one device computes, laid out as the value is (``runtime.differentiable`` says how each collective answers):

1. each collective's issue and wait become one differentiable call (``summed``, ``gathered``, ``reduce_scattered``,
   ``exchanged``) where it was issued: the ranks issue collectives in one order (``schedule_collectives``), while
   each rank's waits sit where its own costs put them. The overlap of the inference program is given up;
2. where a value replicated over an axis is read by an op whose result is not (a column shard of a projection, a
   rank's slice of the rows, a product with a partial sum), each rank's backward holds only its share of that
   value's gradient: ``sum_gradients`` between them sums the shares over the axis. That is how the gradients of
   replicated weights (a LoRA A beside a column-parallel projection, every weight over ulysses, ring and dp) are
   reduced, and why replicas never drift;
3. ``aten.copy`` (an in-place ``copy_`` made functional, which has no derivative) becomes its value: the source,
   cast and broadcast.

What cannot be paired refuses by name (``BackwardUnsupported``): an output that is not whole on every rank, a
collective this pass does not know, a value whose placement it cannot read.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from ..errors import BackwardUnsupported
from ..frontend.trace import copy_graph_module
from ..placement import Replicate
from ..runtime import collectives, differentiable
from .annotate_heads import module_path
from ..annotations import annotation, copied_meta

aten = torch.ops.aten
functional = collectives.functional


def run(gm: GraphModule, mesh, owner: str) -> GraphModule:
    """A copy of the rank program ``gm`` whose backward is exact; raises ``BackwardUnsupported`` naming what is not."""
    gm = copy_graph_module(gm)
    _pair_collectives(gm, mesh, owner)
    _copy_as_value(gm)
    _sum_shared_gradients(gm, mesh, owner)
    _check_outputs_whole(gm, mesh, owner)
    gm.graph.lint()
    gm.recompile()
    return gm


def _where(node: Node) -> str:
    path = module_path(node)
    return node.name + (f" (in {path})" if path else "")


def _paired(issue: Node, wait: Node, target, args: tuple) -> None:
    """One call of ``target`` at ``issue``'s place, for the pair: the wait's value and placements, its readers."""
    with issue.graph.inserting_before(issue):
        new = issue.graph.call_function(target, args)
    new.meta = copied_meta(wait)
    wait.replace_all_uses_with(new)
    issue.graph.erase_node(wait)
    issue.graph.erase_node(issue)


def _pair_collectives(gm: GraphModule, mesh, owner: str) -> None:
    graph = gm.graph
    for issue in list(graph.nodes):
        if issue.target is functional.all_reduce.default:
            (wait,) = issue.users
            x, _, group_name = issue.args
            _paired(issue, wait, differentiable.summed, (x, group_name))
        elif issue.target in collectives.STARTS:
            (wait,) = issue.users
            index = mesh.coordinate(annotation(issue).collective[1])
            if issue.target is collectives.all_gather_start:
                x, dim, sizes, group_name = issue.args
                _paired(issue, wait, differentiable.gathered, (x, dim, sizes, index, group_name))
            elif issue.target is collectives.reduce_scatter_start:
                x, dim, sizes, group_name = issue.args
                _paired(issue, wait, differentiable.reduce_scattered, (x, dim, sizes, index, group_name))
            else:
                x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank, _order, group_name, *low = issue.args
                if low:
                    raise BackwardUnsupported(f"{owner}: backward through an exchange in {low[0]} at {_where(issue)}: "
                                              "exchange_dtype is for inference (its rounding has no gradient)")
                _paired(issue, wait, differentiable.exchanged,
                        (x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank, group_name))
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            raise BackwardUnsupported(f"{owner}: backward through a partitioned program: the collective "
                                      f"{node.target} at {_where(node)} has no paired backward here")


def _copy_as_value(gm: GraphModule) -> None:
    """``aten.copy(self, src)`` is ``src`` cast to ``self``'s dtype and broadcast to its shape (autograd has no
    derivative for ``aten.copy``)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not aten.copy.default:
            continue
        destination, source = node.args[:2]
        like = destination.meta["val"]
        with graph.inserting_before(node):
            cast = graph.call_function(aten._to_copy.default, (source,), {"dtype": like.dtype})
            value = graph.call_function(aten.expand.default, (cast, list(like.shape)))
            owned = graph.call_function(aten.clone.default, (value,))
        for new in (cast, value, owned):
            new.meta = {key: node.meta[key] for key in ("val", "nn_module_stack", "stack_trace") if key in node.meta}
            annotation(new).placements = annotation(node).placements
        if isinstance(source.meta.get("val"), torch.Tensor):  # (the cast has the source's shape)
            cast.meta["val"] = source.meta["val"].to(like.dtype)
        node.replace_all_uses_with(owned)
        graph.erase_node(node)


def _replicated(placement) -> bool:
    """Whole on every rank: Replicate, or a tuple (multi-output op) of them."""
    if isinstance(placement, tuple):
        return all(map(_replicated, placement))
    return isinstance(placement, Replicate)


def _differentiable_value(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _sum_shared_gradients(gm: GraphModule, mesh, owner: str) -> None:
    """``sum_gradients`` between a value replicated over an axis and every op reading it whose result is not."""
    graph = gm.graph
    inserted: dict[tuple[Node, tuple[str, ...]], Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is differentiable.sum_gradients:
            continue
        readers = annotation(node).placements

        def shared(source: Node) -> Node:
            if not isinstance(source, Node) or not _differentiable_value(source):
                return source
            placements = annotation(source).placements
            if placements is None or readers is None:
                raise BackwardUnsupported(f"{owner}: backward through a partitioned program: the placement of "
                                          f"{_where(source if placements is None else node)} is not recorded, so "
                                          "its gradient cannot be laid out")
            axes = tuple(axis for axis in mesh.axis_names
                         if _replicated(placements.get(axis)) and not _replicated(readers.get(axis)))
            if not axes:
                return source
            if (source, axes) not in inserted:
                with graph.inserting_after(source):
                    summed = graph.call_function(differentiable.sum_gradients,
                                                 (source, [mesh.group_name(axis) for axis in axes]))
                summed.meta = {key: source.meta[key] for key in ("val", "nn_module_stack") if key in source.meta}
                annotation(summed).placements = annotation(source).placements
                inserted[(source, axes)] = summed
            return inserted[(source, axes)]

        node.args = map_arg(node.args, shared)
        node.kwargs = map_arg(node.kwargs, shared)


def _check_outputs_whole(gm: GraphModule, mesh, owner: str) -> None:
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    for value in output.all_input_nodes:
        placements = annotation(value).placements or {}
        partial = [axis for axis in mesh.axis_names if not _replicated(placements.get(axis))]
        if partial and _differentiable_value(value):
            raise BackwardUnsupported(f"{owner}: backward through a partitioned program: the output {_where(value)} "
                                      f"is not whole on every rank over {partial}")
