"""collective_kernels: the ops that cannot run on split rows as they are become kernels that communicate inside.

Requires: ``insert_collectives`` (every edge placed as its consumer requires).
Guarantees:

- an attention whose keys a ring axis shards is ``collectives.ring_attention`` (key/value blocks passed round the
  ring inside it, its mask's key columns picked per block);
- a convolution whose rows a sequence axis splits along a spatial dim is ``collectives.halo_convolution`` (each
  rank borrows the kernel's reach of rows from its two neighbours);
- a group_norm over positions a sequence axis splits is ``collectives.sharded_group_norm`` (each group's
  statistics combined across the ranks); interpolating upsampling over split rows is
  ``collectives.halo_interpolation``;
- an attention whose query or key rows came through a packed exchange (a joint sequence, delivered rank by rank)
  reads its mask in that order too, and its values (or keys) that did not come through one in that order; a
  flex_attention reads such rows put back in sequence order (its score_mod and block mask index them) and hands
  its output on in the queries' rank order.

New nodes carry ``annotation.collective = (kind, axis)``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..kinds import CollectiveKind
from ..mesh import SEQUENCE_AXES
from ..placement import PackedShard, Replicate, delivery_order, is_sharded, shard_slices
from ..rules import PartitionError
from ..rules.attention import FLEX_ATTENTION, ring_split_axes
from ..rules.conv import (GROUPS_ARGUMENT, conv_arguments, groups_of, halo_rows, output_padding_of, pad_mode,
                          padding_pairs)
from ..rules.spatial import INTERPOLATING
from ..runtime import collectives
from .context import PassContext
from .insert_collectives import axis_sizes, rekey, split_size
from ..annotations import annotation

aten = torch.ops.aten
_HALOS = (collectives.halo_convolution, collectives.halo_transposed_convolution)
_ATTENTION = aten.scaled_dot_product_attention.default
R = Replicate()


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    _flex_in_sequence_order(gm, ctx)
    _values_in_rank_order(gm, ctx)
    _masks_in_rank_order(gm, ctx)
    _ring_attentions(gm, ctx)
    _halo_convolutions(gm, ctx)
    _group_norms(gm, ctx)
    _interpolations(gm, ctx)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: no attention is left with ring-sharded keys, no convolution with rows split along a spatial
    dim."""
    for node in gm.graph.nodes:
        if node.target is _ATTENTION and ring_split_axes(node):
            raise InvariantError(f"{node.name}: an attention over ring-sharded keys is not a ring_attention")
        if node.target in GROUPS_ARGUMENT and node.target not in _HALOS:
            if any(halo_rows(node, p.dim) != (0, 0) for p in _spatial_axes(node).values()):
                raise InvariantError(f"{node.name}: a convolution over split rows is not a halo_convolution")
        if node.target is aten.group_norm.default and _spatial_axes(node):
            raise InvariantError(f"{node.name}: a group_norm over split positions is not a sharded_group_norm")




def _rank_order(graph, mask: Node, dim: int, blocks: tuple[int, ...], ranks: int, attention: Node) -> Node:
    """``mask`` with its ``dim`` reordered as a packed exchange delivers rows: rank by rank, each rank's part of
    every block in turn."""
    return _reordered(graph, mask, dim, delivery_order(PackedShard(dim, blocks), sum(blocks), ranks), attention)


def _sequence_order(graph, rows: Node, dim: int, blocks: tuple[int, ...], ranks: int, attention: Node) -> Node:
    """``rows`` delivered by a packed exchange (rank by rank) put back in sequence order along ``dim``."""
    delivered, at = [], 0
    for start, end in delivery_order(PackedShard(dim, blocks), sum(blocks), ranks):
        delivered.append((start, at, end - start))
        at += end - start
    return _reordered(graph, rows, dim, [(at, at + length) for _, at, length in sorted(delivered)], attention)


def _reordered(graph, value: Node, dim: int, ranges: list[tuple[int, int]], before: Node) -> Node:
    """``value``'s ``[start, end)`` ranges along ``dim``, joined in the order given, inserted before ``before``."""
    pieces, val = [], value.meta["val"]
    with graph.inserting_before(before):
        for start, end in ranges:
            if end > start:
                piece = graph.call_function(aten.slice.Tensor, (value, dim, start, end))
                _like(piece, value, val.narrow(dim, start, end - start))
                pieces.append(piece)
        joined = graph.call_function(aten.cat.default, (pieces, dim))
    with val.fake_mode:
        _like(joined, value, torch.cat([p.meta["val"] for p in pieces], dim))
    return joined


def _flex_in_sequence_order(gm: GraphModule, ctx: PassContext) -> None:
    """A flex_attention whose rows came through a packed exchange (a joint sequence, rank by rank) reads them in
    sequence order, as its score_mod and block mask index them, and hands its output on in the queries' rank
    order, as the exchange back expects (scaled_dot_product_attention, blind to the order, needs neither)."""
    for node in [n for n in gm.graph.nodes if n.target is FLEX_ATTENTION]:
        queries = annotation(node.args[0]).rank_order
        for value in dict.fromkeys(node.args[:3]):
            if annotation(value).rank_order is not None:
                axis, blocks = annotation(value).rank_order
                ordered = _sequence_order(gm.graph, value, 2, blocks, ctx.mesh.size(axis), node)
                node.replace_input_with(value, ordered)
                rekey(node, value, ordered)
        if queries is None:
            continue
        axis, blocks = queries
        for output in [user for user in node.users if user.users]:  # (its getitems: output, logsumexp)
            users = list(output.users)
            ordered = _rank_order(gm.graph, output, 2, blocks, ctx.mesh.size(axis), output.next)
            annotation(ordered).rank_order = queries
            for user in users:
                user.replace_input_with(output, ordered)
                rekey(user, output, ordered)


def _like(node: Node, mask: Node, val) -> None:
    """A rewrite of ``mask`` along dims no axis shards: its placements, reading its inputs as they are."""
    node.meta["val"] = val
    annotation(node).placements = dict(annotation(mask).placements)
    annotation(node).required = {axis: {n: annotation(n).placements[axis] for n in node.all_input_nodes}
                                 for axis in annotation(mask).placements}


def _values_in_rank_order(gm: GraphModule, ctx: PassContext) -> None:
    """An attention whose keys came through a packed exchange (rows rank by rank) and whose values did not (whole,
    or plainly sharded: rows in sequence order), or the other way round, reads both in the packed order: key row i
    must meet value row i (Helios' values are computed whole, its keys packed)."""
    for node in list(gm.graph.nodes):
        if node.target is not _ATTENTION:
            continue
        k, v = node.args[1:3]
        orders = annotation(k).rank_order, annotation(v).rank_order
        if k is v or (orders[0] is None) == (orders[1] is None):
            continue
        slot, (axis, blocks) = (2, orders[0]) if orders[0] is not None else (1, orders[1])
        value = node.args[slot]
        reordered = _rank_order(gm.graph, value, 2, blocks, ctx.mesh.size(axis), node)
        annotation(reordered).rank_order = (axis, blocks)
        node.update_arg(slot, reordered)  # (that slot only: queries read as the same value keep their order)
        if value in node.args:
            for requirements in annotation(node).required.values():
                if value in requirements:
                    requirements[reordered] = requirements[value]
        else:
            rekey(node, value, reordered)


def _masks_in_rank_order(gm: GraphModule, ctx: PassContext) -> None:
    """An attention whose query or key rows came through a packed exchange (a joint sequence, rank by rank) reads
    its mask in that order too."""
    for node in list(gm.graph.nodes):
        if node.target is not _ATTENTION or all(n in node.args[:3] for n in node.all_input_nodes):
            continue
        q, k = node.args[:2]
        orders = {-2: annotation(q).rank_order, -1: annotation(k).rank_order}
        for mask in [n for n in node.all_input_nodes if n not in node.args[:3]]:
            for dim, order in orders.items():
                if order is not None and mask.meta["val"].shape[dim] != 1:
                    axis, blocks = order
                    reordered = _rank_order(gm.graph, mask, dim % mask.meta["val"].dim(), blocks,
                                            ctx.mesh.size(axis), node)
                    node.replace_input_with(mask, reordered)
                    rekey(node, mask, reordered)
                    mask = reordered


def _ring_attentions(gm: GraphModule, ctx: PassContext) -> None:
    """An attention whose keys a ring axis shards becomes ``collectives.ring_attention``: its q, k and v are this
    rank's rows (after any Ulysses exchange), the key/value blocks travel round the ring inside it."""
    for node in gm.graph.nodes:
        if node.target is not _ATTENTION:
            continue
        q, k, v = node.args[:3]
        axes = ring_split_axes(node)
        if not axes:
            continue
        if len(axes) > 1:
            raise PartitionError(f"{node.name}: keys sharded over several ring axes {axes}")
        axis = axes[0]
        keys = annotation(node).required[axis][k]
        rows = axis_sizes(k, keys, axis, ctx)
        mask = _attention_mask(node)
        size = split_size(k, keys, axis, ctx)  # each rank's key columns of the mask: its part of every block
        columns = [shard_slices(keys, size, ctx.mesh.size(axis), holder) for holder in range(ctx.mesh.size(axis))]
        node.target = collectives.ring_attention
        node.args = (q, k, v, node.kwargs.get("scale"), rows, ctx.mesh.coordinate(axis), ctx.mesh.group_name(axis),
                     *((mask, columns) if mask is not None else ()))
        node.kwargs = {}
        annotation(node).collective = (CollectiveKind.RING_PASS, axis)


def _attention_mask(node: Node) -> Node | None:
    """The attn_mask argument of a scaled_dot_product_attention node, if any."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask if isinstance(mask, Node) else None


def _halo_convolutions(gm: GraphModule, ctx: PassContext) -> None:
    """A convolution whose input rows a sequence axis splits along a spatial dim becomes
    ``collectives.halo_convolution``: each rank borrows the kernel's reach of rows from its two neighbours."""
    for node in gm.graph.nodes:
        if node.target not in GROUPS_ARGUMENT or node.target in _HALOS:
            continue
        x, split = node.args[0], _split_axis(node, "a convolution")
        if split is None:
            continue
        axis, placement = split
        if [p.dim for p in annotation(x).placements.values() if is_sharded(p)].count(placement.dim) > 1:
            raise PartitionError(f"{node.name}: a convolution over a dim split by several axes "
                                 f"({annotation(x).placements}); its halo exchange runs over one sequence axis")
        rows = halo_rows(node, placement.dim)
        if rows == (0, 0):  # a kernel of one row along the split dim: each rank's rows suffice
            continue
        stride, plain_padding, dilation, transposed = conv_arguments(node)
        bias, groups = node.args[2] if len(node.args) > 2 else None, groups_of(node)
        ring = (ctx.mesh.coordinate(axis), ctx.mesh.size(axis), ctx.mesh.group_name(axis))
        if transposed:
            node.target = collectives.halo_transposed_convolution
            node.args = (x, node.args[1], bias, stride, plain_padding, output_padding_of(node), groups, dilation,
                         placement.dim, *rows, *ring)
        else:
            padding = padding_pairs(node)
            padding[placement.dim - 2] = list(rows)
            mode = pad_mode(node)
            node.target = collectives.halo_convolution
            node.args = (x, node.args[1], bias, stride, padding, dilation, groups, placement.dim, *ring,
                         *((mode,) if mode != "constant" else ()))
        node.kwargs = {}
        annotation(node).collective = (CollectiveKind.HALO_EXCHANGE, axis)


def _spatial_axes(node: Node) -> dict[str, object]:
    """The sequence axes that split ``node``'s first input along a spatial dim (2 or later), with their placement."""
    x, required = node.args[0], (annotation(node).required or {})
    return {axis: required[axis][x] for axis in SEQUENCE_AXES
            if is_sharded(required.get(axis, {}).get(x, R)) and required[axis][x].dim >= 2}


def _split_axis(node: Node, what: str) -> tuple[str, object] | None:
    """The one sequence axis that splits ``node``'s first input along a spatial dim, with its placement; None when
    none does. Several: a PartitionError (each kernel exchanges over one axis)."""
    spatial = _spatial_axes(node)
    if len(spatial) > 1:
        raise PartitionError(f"{node.name}: {what} over positions split by several axes {list(spatial)}")
    return next(iter(spatial.items()), None)


def _group_norms(gm: GraphModule, ctx: PassContext) -> None:
    """A group_norm whose positions a sequence axis splits becomes ``collectives.sharded_group_norm``: each
    group's count, mean and spread combined across that axis's ranks."""
    for node in gm.graph.nodes:
        if node.target is not aten.group_norm.default or (split := _split_axis(node, "a group_norm")) is None:
            continue
        axis, _ = split
        args = list(node.args) + [None] * (5 - len(node.args))
        eps = node.kwargs.get("eps", 1e-5 if args[4] is None else args[4])
        node.target = collectives.sharded_group_norm
        node.args = (args[0], args[1], args[2], args[3], eps, ctx.mesh.group_name(axis))
        node.kwargs = {}
        annotation(node).collective = (CollectiveKind.ALL_REDUCE, axis)


def _interpolations(gm: GraphModule, ctx: PassContext) -> None:
    """Interpolating upsampling over rows a sequence axis splits becomes ``collectives.halo_interpolation``: each
    rank borrows the rows past its own that its edge output rows read."""
    for node in gm.graph.nodes:
        if node.target not in INTERPOLATING or (split := _split_axis(node, "upsampling")) is None:
            continue
        axis, placement = split
        mode, reach = INTERPOLATING[node.target]
        node.target = collectives.halo_interpolation
        node.args = (node.args[0], mode, list(node.args[3]), placement.dim, reach, ctx.mesh.coordinate(axis),
                     ctx.mesh.size(axis), ctx.mesh.group_name(axis))
        node.kwargs = {}
        annotation(node).collective = (CollectiveKind.HALO_EXCHANGE, axis)
