"""insert_collectives: redistribute every value whose placement differs from what its consumer requires.

Requires: the PLAN passes have run (``annotation.placements`` and ``annotation.required`` on every node).
Guarantees: for every edge, the producer's placement equals the consumer's requirement:

- Partial -> Replicate: functional ``all_reduce`` + ``wait_tensor`` right after the producer, once for all of its
  consumers. A row-wise linear's bias is moved after the reduction, so it is added once, not once per rank.
- Partial -> Shard, when every consumer wants the same ``Shard`` or ``InnerShard`` (``plan_tp_sequence``'s rows):
  ``collectives.reduce_scatter_start`` and ``_wait``, the bias moved after it likewise: whole where the sum's
  rows are split, this rank's slice of it where its features are (else the sum is all-reduced, then sliced).
- an ``InnerShard`` (tp's rows inside a sequence axis's shard) is sliced after every other axis, gathered before.
- Shard -> Replicate: ``collectives.all_gather_start`` and ``_wait`` (uneven shards padded to the largest, then
  trimmed). A collective issued by one node and waited on by another (these, all_reduce, all_to_all) lets
  ``schedule_collectives`` run independent compute while it is in flight.
- Shard(a) -> Shard(b): ``collectives.all_to_all_start`` and ``_wait`` (Ulysses: sequence-sharded <->
  head-sharded).
- Replicate -> Shard: a local slice of this rank's part; no communication.
(Attentions over ring-sharded keys and convolutions over split rows become kernels in ``collective_kernels``.)

New nodes carry ``annotation.collective = (kind, axis)`` when they communicate.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..kinds import CollectiveKind
from ..placement import (InnerShard, PackedShard, Partial, Replicate, Shard, block_offsets, delivery_order, is_sharded,
                         local_shape, packed_shard, shard_slices, shard_widths)
from ..rules import PartitionError
from ..rules.reductions import all_dims
from ..rules.attention import FLEX_ATTENTION
from ..rules.pointwise import METADATA_ARGUMENTS
from ..source import source_line
from ..runtime import collectives, low_precision
from . import device_layout
from .context import PassContext
from ..annotations import annotation

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default
functional = torch.ops._c10d_functional
R = Replicate()


def _annotate(node: Node, like: Node, axis: str, placement, required: dict, collective: str | None = None,
              val=None) -> Node:
    """Metadata for a new node: global value ``val`` (default: ``like``'s), placement, input requirements."""
    node.meta["val"] = like.meta["val"] if val is None else val
    annotation(node).placements = {**annotation(like).placements, axis: placement}
    # over every other axis the new node takes its inputs as they are
    annotation(node).required = {other: {n: annotation(n).placements[other] for n in node.all_input_nodes}
                                 for other in annotation(like).placements if other != axis}
    annotation(node).required[axis] = required
    for key in ("nn_module_stack", "stack_trace"):  # an error or a dump at this node names the model's line
        if key in like.meta:
            node.meta[key] = like.meta[key]
    if collective:
        annotation(node).collective = (CollectiveKind(collective), axis)
    return node


def _has_bias(node: Node) -> bool:
    return node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None


def _splits_features(linear: Node, placement) -> bool:
    """Whether ``placement`` of a linear's output splits its last dim: the features its bias spans."""
    return is_sharded(placement) and placement.dim % len(linear.meta["val"].shape) == len(linear.meta["val"].shape) - 1


def _bias_sliced_alike(linear: Node, placement, axis: str) -> bool:
    """Whether the bias can meet a sum split as ``placement``: split along rows it broadcasts whole; split along
    its features, only a plain ``Shard`` that no other axis nests with is sliced alike (the same length split
    over the same ranks); otherwise the sum is reduced whole first (decided by the placements, never a size)."""
    if not _has_bias(linear) or not _splits_features(linear, placement):
        return True
    others = [p for other, p in annotation(linear).placements.items() if other != axis]
    return isinstance(placement, Shard) and not any(_splits_features(linear, p) for p in others)


def _move_bias_after(linear: Node, reduced: Node, axis: str, placement=R) -> Node:
    """linear(x, W_shard, b) summed over ranks would add b once per rank: add it once after the sum (``placement``:
    the sum's). A sum split along rows meets the whole bias; one split along the features this rank's slice of it
    (``_bias_sliced_alike``), which the redistribution below cuts."""
    bias = linear.args[2]
    linear.args = linear.args[:2]
    for requirements in annotation(linear).required.values():
        requirements.pop(bias, None)
    graph = linear.graph
    with graph.inserting_after(reduced):
        added = graph.call_function(aten.add.Tensor, (reduced, bias))
    sliced = Shard(0) if _splits_features(linear, placement) else R
    return _annotate(added, linear, axis, placement, {reduced: placement, bias: sliced})


def attention_rows(output: Node) -> Node | None:
    """The queries whose rows an attention's output comes in, where ``output`` is one: scaled_dot_product_attention,
    or an element of flex_attention's (output, logsumexp) (``collective_kernels`` hands it on in the queries'
    order)."""
    if output.target is _ATTENTION:
        return output.args[0]
    if output.target is operator.getitem and getattr(output.args[0], "target", None) is FLEX_ATTENTION:
        return output.args[0].args[0]
    return None


def rekey(user: Node, old: Node, new: Node) -> None:
    """``user`` now reads ``new`` where it read ``old``: its requirements (every axis) follow."""
    for requirements in annotation(user).required.values():
        if old in requirements:
            requirements[new] = requirements.pop(old)


def _all_reduce(producer: Node, axis: str, ctx: PassContext) -> Node:
    graph = producer.graph
    users = list(producer.users)
    with graph.inserting_after(producer):
        reduce = graph.call_function(functional.all_reduce.default, (producer, "sum", ctx.mesh.group_name(axis)))
    with graph.inserting_after(reduce):
        wait = graph.call_function(functional.wait_tensor.default, (reduce,))
    _annotate(reduce, producer, axis, Partial(), {producer: Partial()}, "all_reduce")
    return _replace_with_sum(producer, users, _annotate(wait, producer, axis, R, {reduce: Partial()}), axis, R)


def _replace_with_sum(producer: Node, users: list[Node], summed: Node, axis: str, placement) -> Node:
    """``summed``, the producer's sum over ``axis`` (placed ``placement``), is what its users read; a row-wise
    linear's bias is added once, after the sum."""
    result = summed
    if _has_bias(producer):
        result = _move_bias_after(producer, summed, axis, placement)
    for user in users:
        user.replace_input_with(producer, result)
        rekey(user, producer, result)
        if _reads_only_metadata(user, result):  # (it took the partial sum as it was: it reads the sum alike)
            annotation(user).required[axis][result] = placement
    return result


def _reads_only_metadata(user: Node, value: Node) -> bool:
    """``user`` reads ``value`` only for its dtype, device or shape (``type_as``'s second argument)."""
    positions = METADATA_ARGUMENTS.get(user.target, ())
    return bool(positions) and value not in user.kwargs.values() and \
        all(index in positions for index, argument in enumerate(user.args) if argument is value)


def _issued(producer: Node, start, start_args: tuple, wait, wait_args: tuple, axis: str, current, placement,
            kind: str) -> Node:
    """A collective in two nodes, so that ``schedule_collectives`` can run independent compute while it is in
    flight: ``start`` issues it (its buffer shaped as the collective moves it, ``annotation.in_flight``: it keeps its
    input's placement for bookkeeping, but is no slice of a global value) and ``wait`` waits for it and gives the
    value placed ``placement``."""
    graph = producer.graph
    with graph.inserting_after(producer):
        issue = graph.call_function(start, (producer, *start_args))
    with graph.inserting_after(issue):
        done = graph.call_function(wait, (issue, *wait_args))
    annotation(_annotate(issue, producer, axis, current, {producer: current}, kind)).in_flight = True
    return _annotate(done, producer, axis, placement, {issue: current})


def _reduce_scatter(producer: Node, placement, axis: str, ctx: PassContext) -> Node:
    users = list(producer.users)
    sizes = axis_sizes(producer, placement, axis, ctx)
    summed = _issued(producer, collectives.reduce_scatter_start, (placement.dim, sizes, ctx.mesh.group_name(axis)),
                     collectives.reduce_scatter_wait, (placement.dim, sizes[ctx.mesh.coordinate(axis)]), axis,
                     Partial(), placement, "reduce_scatter")
    return _replace_with_sum(producer, users, summed, axis, placement)


def _scattered_as(producer: Node, axis: str):
    """The plain shard every consumer of a partial sum wants over ``axis``, if they all want the same one."""
    wanted = {repr(p): p for p in (annotation(user).required.get(axis, {}).get(producer) for user in producer.users)}
    placement = next(iter(wanted.values())) if len(wanted) == 1 else None
    return placement if isinstance(placement, (Shard, InnerShard)) else None


def axis_sizes(producer: Node, placement, axis: str, ctx: PassContext) -> list[int]:
    """How many elements of ``placement``'s dim each rank of ``axis`` holds: the size left by outer axes, split as
    the placement says (as evenly as can be, in whole units)."""
    return shard_widths(placement, split_size(producer, placement, axis, ctx), ctx.mesh.size(axis))


def split_size(producer: Node, placement, axis: str, ctx: PassContext) -> int:
    """The size of ``placement``'s dim that ``axis`` splits: what the axes applied before it leave (all the others
    for an ``InnerShard``)."""
    placements = {**annotation(producer).placements, axis: placement}
    return local_shape(producer.meta["val"].shape, placements, ctx.mesh, upto=axis)[placement.dim]


def _all_gather(producer: Node, placement, axis: str, ctx: PassContext) -> Node:
    sizes = axis_sizes(producer, placement, axis, ctx)
    gathered = _issued(producer, collectives.all_gather_start, (placement.dim, sizes, ctx.mesh.group_name(axis)),
                       collectives.all_gather_wait, (placement.dim, sizes), axis, placement, R, "all_gather")
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        size = split_size(producer, placement, axis, ctx)
        return _in_sequence_order(gathered, producer, placement, size, axis, ctx)
    return gathered


def _in_sequence_order(gathered: Node, like: Node, placement: PackedShard, size: int, axis: str,
                       ctx: PassContext) -> Node:
    """The rows of a gathered packed value, which arrive rank by rank (each rank's part of every block in turn),
    put back in the value's order along ``placement.dim``: static slices and one cat, no communication."""
    dim, graph = placement.dim, gathered.graph
    pieces, position = [], 0  # (start in the value, start in the gathered rows, length)
    for start, end in delivery_order(placement, size, ctx.mesh.size(axis)):
        pieces.append((start, position, end - start))
        position += end - start
    sliced, anchor, val = [], gathered, like.meta["val"]
    for _, at, length in sorted(pieces):
        if length == 0:
            continue
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.slice.Tensor, (gathered, dim, at, at + length))
        annotation(anchor).local_slice = True  # bounds in the gathered rank order, not the value's
        sliced.append(_annotate(anchor, like, axis, R, {gathered: R}, val=val.narrow(dim, 0, length)))
    with graph.inserting_after(anchor):
        joined = graph.call_function(aten.cat.default, (sliced, dim))
    return _annotate(joined, like, axis, R, {p: R for p in sliced})


def _all_to_all(producer: Node, current, required, axis: str, ctx: PassContext, consumer: Node) -> Node:
    """Shard(a) -> Shard(b) over one axis: every rank sends each peer its part of b, receives its part of a.

    A packed shard (a joint text + image sequence, each part sharded on its own) is exchanged as a plain one only
    into or out of an attention: the gathered rows come in rank order, a permutation of the sequence that attention
    does not see (keys and values permuted alike, checked by its rule), and the exchange back inverts it."""
    packed = isinstance(current, PackedShard) or isinstance(required, PackedShard)
    around_attention = (consumer.target in (_ATTENTION, FLEX_ATTENTION) and producer in consumer.args[:3]) or \
        attention_rows(producer) is not None
    if packed and (not around_attention or current.dim == required.dim):
        return _gathered_then_narrowed(producer, current, required, axis, ctx)
    dims = (required.dim, current.dim, axis_sizes(producer, required, axis, ctx),
            axis_sizes(producer, current, axis, ctx), ctx.mesh.coordinate(axis))
    order = device_layout.memory_order(device_layout.strides_on_device(producer, ctx.mesh.device_type))
    # (the wait names the shape it joins: the global one here, this rank's once localize has run)
    # (pieces in a lower precision only where asked for: the arguments, and so the program, are otherwise unchanged)
    value = producer.meta["val"]
    low = (ctx.exchange_dtype,) if low_precision.pays(value.shape, value.dtype, ctx.exchange_dtype, required.dim,
                                                       current.dim) else ()
    restored = (*low, value.dtype) if low else ()
    exchange = _issued(producer, collectives.all_to_all_start, (*dims, order, ctx.mesh.group_name(axis), *low),
                       collectives.all_to_all_wait, (list(value.shape), *dims, order, *restored), axis, current,
                       required, "all_to_all")
    if isinstance(current, PackedShard):  # rows now in rank order: a mask of the attention must follow them
        annotation(exchange).rank_order = (axis, current.blocks)
    return exchange


def _gathered_then_narrowed(producer: Node, current, required, axis: str, ctx: PassContext) -> Node:
    """A packed shard re-split anywhere but around an attention (StableAudio-3's joint rows into a feed-forward
    laid out otherwise): an all_to_all would leave its rows in rank order, so the value is gathered in sequence
    order and this rank's part of ``required`` sliced from it. Exact; it moves the whole value rather than a
    rank's share. Refused where another axis splits either dim (the gather assumes this axis alone does)."""
    others = [other for other, p in annotation(producer).placements.items()
              if other != axis and is_sharded(p) and p.dim in (current.dim, required.dim)]
    if others:
        raise PartitionError(f"{producer.name}: an all_to_all of a packed shard over {axis!r} is only exact for an "
                             f"attention's query, key and value and its output, and {others[0]!r} splits the same "
                             "dim, so it cannot be gathered whole instead")
    return _narrow(_all_gather(producer, current, axis, ctx), required, axis, ctx)


def _gather_in_packed_order(attention: Node, current, blocks: tuple[int, ...], axis: str, ctx: PassContext) -> Node:
    """An attention output whose rows are in rank order (each rank's part of every block of a packed joint
    sequence in turn), gathered whole along ``current`` (its heads) and its rows put back in the sequence's order."""
    gathered = _all_gather(attention, current, axis, ctx)
    rows = PackedShard(2, blocks)
    return _in_sequence_order(gathered, attention, rows, sum(blocks), axis, ctx)


def _narrow(producer: Node, placement, axis: str, ctx: PassContext) -> Node:
    """This rank's part of a replicated value: free, no communication."""
    graph = producer.graph
    size = split_size(producer, placement, axis, ctx)
    num, ranges = ctx.mesh.size(axis), shard_slices(placement, size, ctx.mesh.size(axis), ctx.mesh.coordinate(axis))
    if len(ranges) == 1:
        pieces = [(placement, None)]
    else:  # one piece per block of a packed shard: globally that block, this rank holding its part of it
        offsets, whole = block_offsets(placement.blocks), producer.meta["val"]
        pieces = [(packed_shard(placement.dim, (block,), placement.unit, num),
                   whole.narrow(placement.dim, offset, block) if whole.shape[placement.dim] == size else None)
                  for offset, block in zip(offsets, placement.blocks)]
    anchor = producer
    for index, (start, end) in enumerate(ranges):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.slice.Tensor, (producer, placement.dim, start, end))
        annotation(anchor).local_slice = True  # its bounds are this rank's already (localize leaves them)
        piece_placement, val = pieces[index]
        pieces[index] = _annotate(anchor, producer, axis, piece_placement, {producer: R}, val=val)
    if len(pieces) == 1:
        return pieces[0]
    with graph.inserting_after(anchor):
        joined = graph.call_function(aten.cat.default, (pieces, placement.dim))
    return _annotate(joined, producer, axis, placement, {p: annotation(p).placements[axis] for p in pieces})


def _redistribute(producer: Node, current, required, axis: str, ctx: PassContext, consumer: Node) -> Node:
    queries = attention_rows(producer)
    order = annotation(queries).rank_order if queries is not None else None
    if order is not None and order[0] == axis and required == R and is_sharded(current) and current.dim != 2:
        return _gather_in_packed_order(producer, current, order[1], axis, ctx)
    if order is not None and order[0] == axis and required != PackedShard(2, order[1]):
        raise PartitionError(f"{producer.name}: the attention's rows are in rank order (a packed joint sequence) "
                             f"and {consumer.name} needs them as {required}; only the exchange back to the packed "
                             "layout restores their order. Partition without this axis, or report the model")
    if current == R and is_sharded(required):
        inner = _inner_splits(producer, required, axis, ctx)
        if inner:  # this rank's rows of the outer shard are not all here: gather the inner axes, slice both
            gathered = producer
            for other, placement in reversed(inner):
                gathered = _all_gather(gathered, placement, other, ctx)
            narrowed = _narrow(gathered, required, axis, ctx)
            for other, placement in inner:
                narrowed = _narrow(narrowed, placement, other, ctx)
            return narrowed
        return _narrow(producer, required, axis, ctx)
    if is_sharded(current) and required == R:
        return _all_gather(producer, current, axis, ctx)
    if is_sharded(current) and is_sharded(required):
        return _all_to_all(producer, current, required, axis, ctx, consumer)
    raise PartitionError(f"cannot redistribute {producer.name} from {current} to {required} over {axis!r}, as "
                         f"{consumer.name} ({source_line(consumer) or consumer.target}) needs it")


def _inner_splits(producer: Node, required, axis: str, ctx: PassContext) -> list[tuple[str, object]]:
    """The axes after ``axis`` in mesh order whose (plain) shards of ``producer`` already split the dim ``axis``
    is to slice. Nested axes split outer first (ring's rows, then each ring shard among the Ulysses ranks): a value
    replicated over ``axis`` but split by an inner axis holds that inner axis's part of the whole dim, which does
    not contain this rank's part of the outer shard (ring=2 x ulysses=2, rank (1, 0): rows 2/4-3/4 are wanted,
    rows 0-1/2 are here). A rotary table Ulysses shards and the ring does not, read by a query both shard."""
    if isinstance(required, InnerShard):  # sliced after every other axis: nothing inner to it
        return []
    names = list(ctx.mesh.axis_names)
    return [(other, placement) for other in names[names.index(axis) + 1:]
            for placement in [annotation(producer).placements.get(other, R)]
            if is_sharded(placement) and not isinstance(placement, InnerShard) and placement.dim == required.dim]


def _reduce_partials(gm: GraphModule, ctx: PassContext) -> None:
    """Every partial sum is reduced (or reduce-scattered) right after its producer, before any other axis moves it:
    a row-wise linear's bias is moved after the reduction only when the reduction reads the linear itself (a value
    gathered over a batch axis first would add the bias once per rank)."""
    for axis in ctx.mesh.axis_names:
        for node in list(gm.graph.nodes):
            for producer in list(node.all_input_nodes):
                required = annotation(node).required.get(axis, {}).get(producer)
                if isinstance(annotation(producer).placements[axis], Partial) and required is not None \
                        and not isinstance(required, (tuple, Partial)):
                    scattered = _scattered_as(producer, axis)
                    if scattered is not None and _bias_sliced_alike(producer, scattered, axis):
                        _reduce_scatter(producer, scattered, axis, ctx)
                    else:
                        _all_reduce(producer, axis, ctx)


def _required_local_shape(node: Node, source: Node, ctx: PassContext) -> list[int]:
    """``source``'s shape on this rank as ``node`` reads it (its required placement on every axis)."""
    placements = {axis: required.get(source, R) for axis, required in annotation(node).required.items()}
    return local_shape(source.meta["val"].shape, placements, ctx.mesh)


def _scale_partial_means(gm: GraphModule, ctx: PassContext) -> None:
    """A mean over a sharded dim is this rank's mean of its part: scaled by its share of the elements, the partial
    values then sum to the whole mean (exact for uneven shards too)."""
    for node in list(gm.graph.nodes):
        placements = annotation(node).placements
        if node.target is not aten.mean.dim or not any(isinstance(p, Partial) for p in placements.values()):
            continue
        source = node.args[0]
        shape, local = source.meta["val"].shape, _required_local_shape(node, source, ctx)
        dims = all_dims(node.args[1] if len(node.args) > 1 else None, len(shape))
        share = math.prod(local[d] for d in dims) / math.prod(shape[d] for d in dims)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node, share))
        scaled.meta["val"] = node.meta["val"]
        annotation(scaled).placements = dict(annotation(node).placements)
        annotation(scaled).required = {axis: {node: p} for axis, p in annotation(node).placements.items()}
        for key in ("nn_module_stack", "stack_trace"):
            if key in node.meta:
                scaled.meta[key] = node.meta[key]
        for user in users:
            user.replace_input_with(node, scaled)
            rekey(user, node, scaled)


def _distribute_norms(gm: GraphModule, ctx: PassContext) -> None:
    """rms_norm / layer_norm over a sharded last dim become ``collectives.sharded_*_norm``: the row statistics
    reduced over the axis, each rank normalising its own features."""
    for node in gm.graph.nodes:
        if node.target not in (aten.rms_norm.default, aten.layer_norm.default):
            continue
        source, normalized = node.args[0], node.args[1]
        last = len(source.meta["val"].shape) - 1
        axes = [axis for axis, required in annotation(node).required.items()
                if is_sharded(required.get(source, R)) and required[source].dim == last and len(normalized) == 1]
        if not axes:
            continue
        if len(axes) > 1:
            raise PartitionError(f"{node.name}: a norm over a dim sharded over several axes {axes}")
        axis, args = axes[0], list(node.args) + [None] * 6
        if node.target is aten.rms_norm.default:
            node.target = collectives.sharded_rms_norm
            node.args = (source, args[2], args[3], normalized[0], ctx.mesh.group_name(axis))
        else:
            node.target = collectives.sharded_layer_norm
            node.args = (source, args[2], args[3], 1e-5 if args[4] is None else args[4], normalized[0],
                         ctx.mesh.group_name(axis))
        node.kwargs = {}
        annotation(node).collective = (CollectiveKind.ALL_REDUCE, axis)


def _kind(current, required) -> str:
    if current == R and is_sharded(required):
        return "slice_inner" if isinstance(required, InnerShard) else "slice"
    if is_sharded(current) and required == R:
        return "gather_inner" if isinstance(current, InnerShard) else "gather"
    return "exchange"  # all_to_all, or a partial sum reduced


def _phases(axis_names: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, axes in order) as redistributions happen. Two axes may shard one dim, the inner splitting each shard
    of the outer (tp then ulysses on heads; ring then ulysses on rows), and each collective's sizes assume the
    layout the others leave: slices are taken outer axis first (as local_shape splits), exchanges then run in mesh
    order on those shards, and gathers come last, inner axis first (an outer gather is a plain concatenation only
    once no inner axis splits the dim). An ``InnerShard`` splits inside every other axis: sliced after all others,
    gathered before them."""
    return [("slice", axis_names), ("slice_inner", axis_names), ("exchange", axis_names),
            ("gather_inner", axis_names), ("gather", tuple(reversed(axis_names)))]


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    _scale_partial_means(gm, ctx)
    _reduce_partials(gm, ctx)
    for kind, axes in _phases(ctx.mesh.axis_names):
        for axis in axes:
            _redistribute_axis(gm, ctx, axis, kind)
    _distribute_norms(gm, ctx)
    return gm


def _redistribute_axis(gm: GraphModule, ctx: PassContext, axis: str, kind: str) -> None:
    """Every edge whose placement over ``axis`` differs from its consumer's requirement by a redistribution of
    ``kind`` (see ``_kind``)."""
    redistributed: dict[tuple[Node, str], Node] = {}
    for node in list(gm.graph.nodes):
        for producer in list(node.all_input_nodes):
            required = annotation(node).required.get(axis, {}).get(producer)
            current = annotation(producer).placements[axis]
            if required is None or isinstance(required, tuple) or current == required:
                continue
            if _kind(current, required) != kind:
                continue
            if isinstance(current, Partial):
                producer, current = _all_reduce(producer, axis, ctx), R
                if required == R:
                    continue
            # a packed exchange is exact only for the attention it feeds: never shared with another consumer
            packed = isinstance(current, PackedShard) or isinstance(required, PackedShard)
            key = (producer, repr(required), node if packed and attention_rows(producer) is None else None)
            if key not in redistributed:
                redistributed[key] = _redistribute(producer, current, required, axis, ctx, node)
            node.replace_input_with(producer, redistributed[key])
            rekey(node, producer, redistributed[key])


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every input of every node is placed as that node requires."""
    for node in gm.graph.nodes:
        for axis, requirements in annotation(node).required.items():
            for producer, required in requirements.items():
                if isinstance(required, tuple):
                    continue
                current = annotation(producer).placements[axis]
                if current != required:
                    raise InvariantError(f"{node.name} needs {producer.name} as {required} over {axis!r}, "
                                         f"it is {current}")
