"""Placement propagation rules for one mesh axis: how each aten op carries a sharded value.

Each rule sees a node and the current placement of each of its input values and returns a ``Decision``: the
placement of the node's output and the placement each input must have. An input whose current placement differs
from the one required is redistributed by ``insert_collectives`` (Partial -> Replicate: all_reduce; Shard ->
Replicate: all_gather; Replicate -> Shard: a local slice, free).

A rule raises ``Unshardable`` when a sharded input cannot be carried through the op (a norm over the sharded
dimension, a reshape that mixes it with another dimension, ...). The planner then gives up the column sharding
that led there, or, for a sharding the user forced, gathers the value first (``replicate_all``).

Partial inputs are never carried: every rule asks for them to be reduced first, so a Partial value is reduced
right after the row-wise linear that produced it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import Node

from .errors import PartitionError
from .placement import PackedShard, Partial, Replicate, Shard, is_sharded

aten = torch.ops.aten
R = Replicate()


class Unshardable(Exception):
    """A sharded value reached an op that cannot carry it."""


@dataclass(frozen=True)
class NeedsPacking(Exception):
    """A value sharded as one block is split into ``blocks`` along its sharded dim: its producer must be packed."""
    node: Node
    blocks: tuple[int, ...]


@dataclass
class Decision:
    output: object  # a placement, or a tuple of placements for ops returning several tensors
    inputs: dict[Node, object] = field(default_factory=dict)
    # What consumers get, when it differs from what the op computes: redistributed right after the op
    # (Ulysses attention computes head-sharded and hands back sequence-sharded).
    visible: object = None


@dataclass
class LinearRoles:
    """What the planner decided for each ``aten.linear`` node, read by the linear rule."""
    colwise: set[Node] = field(default_factory=set)
    rowwise: set[Node] = field(default_factory=set)
    replicate: set[Node] = field(default_factory=set)
    forced: set[Node] = field(default_factory=set)  # chosen by the user: never silently changed
    packed: dict[Node, tuple[int, ...]] = field(default_factory=dict)


def shape_of(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _with_dim(placement, dim: int):
    if isinstance(placement, PackedShard):
        return PackedShard(dim, placement.blocks)
    return Shard(dim)


def replicate_all(node: Node, placements) -> Decision:
    """The fallback for any op: every input replicated (reduced, gathered), output replicated."""
    del placements
    if node.op == "output":
        return Decision(None, {n: R for n in node.all_input_nodes})
    out = tuple(R for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else R
    return Decision(out, {n: R for n in node.all_input_nodes})


def _sharded_inputs(node: Node, placements) -> dict[Node, object]:
    return {n: placements[n] for n in node.all_input_nodes if is_sharded(placements.get(n, R))}


def _same_as_input(node: Node, placements, source: Node, *, dont_care: tuple[Node, ...] = ()) -> Decision:
    """Output placed like ``source``; other tensor inputs replicated unless listed as ``dont_care``."""
    inputs = {n: R for n in node.all_input_nodes}
    for n in dont_care:
        inputs[n] = placements.get(n, R)
    inputs[source] = placements.get(source, R)
    if isinstance(inputs[source], Partial):
        inputs[source] = R
    return Decision(inputs[source], inputs)


# --- pointwise ---------------------------------------------------------------------------------------------------

def pointwise(node: Node, placements, axis_size: int) -> Decision:
    """Broadcasting elementwise ops: every sharded input must agree on one output dim; replicated inputs that span
    that dim are sliced locally, broadcast ones (size 1 or missing) stay whole."""
    out_shape = shape_of(node)
    ndim = len(out_shape)
    sharded = _sharded_inputs(node, placements)
    if not sharded:
        return Decision(R, {n: R for n in node.all_input_nodes})
    out_placements = set()
    for n, p in sharded.items():
        out_placements.add(_with_dim(p, p.dim + ndim - len(shape_of(n))))
    if len(out_placements) != 1:
        raise Unshardable(f"inputs sharded differently: {sorted(map(str, out_placements))}")
    out = out_placements.pop()
    inputs = {}
    for n in node.all_input_nodes:
        shape = shape_of(n)
        if n in sharded or shape is None:
            inputs[n] = placements.get(n, R)
            continue
        local_dim = out.dim - (ndim - len(shape))
        if local_dim < 0 or shape[local_dim] == 1:
            inputs[n] = R  # broadcast along the sharded dim
        else:
            inputs[n] = _with_dim(out, local_dim)
    return Decision(out, inputs)


# --- views -------------------------------------------------------------------------------------------------------

def _view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products (the dims a view merges or splits)."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi == pj and gi and gj:
                break
            if (pi <= pj and i < len(in_shape)) or j >= len(out_shape):
                if i >= len(in_shape):
                    break
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        # trailing size-1 dims join the last group
        while i < len(in_shape) and in_shape[i] == 1 and j >= len(out_shape):
            gi.append(i)
            i += 1
        while j < len(out_shape) and out_shape[j] == 1 and i >= len(in_shape):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _heads_do_not_split(node: Node, axis_size: int) -> None:
    """A head reshape or projection (annotated by annotate_heads) that does not split evenly is a user error:
    tensor parallelism needs whole heads on every rank."""
    heads = node.meta.get("heads")
    if heads is not None:
        raise PartitionError(f"{heads.module}: {heads.heads} attention heads cannot be split evenly over a tp "
                             f"degree of {axis_size}; use a degree that divides {heads.heads}")


def _view_shard_dim(in_shape, out_shape, dim: int, axis_size: int) -> int:
    """The output dim a view carries input dim ``dim``'s sharding to, or Unshardable."""
    for gi, gj in _view_groups(in_shape, out_shape):
        if dim not in gi:
            continue
        lead_in = next(d for d in gi if in_shape[d] != 1) if any(in_shape[d] != 1 for d in gi) else gi[0]
        lead_out = next((d for d in gj if out_shape[d] != 1), gj[0] if gj else None)
        if dim != lead_in or lead_out is None:
            raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} mixes the sharded dim {dim} "
                              "with another dim")
        # a dim passed through unchanged may split unevenly; one merged or split with others must split evenly
        passthrough = [d for d in gi if in_shape[d] != 1] == [dim] and in_shape[dim] == out_shape[lead_out] \
            and [d for d in gj if out_shape[d] != 1] == [lead_out]
        if not passthrough and (in_shape[dim] % axis_size or out_shape[lead_out] % axis_size):
            raise Unshardable(f"the view {list(in_shape)} -> {list(out_shape)} regroups the sharded dim {dim}, "
                              f"whose size does not split evenly over {axis_size}")
        return lead_out
    raise Unshardable(f"dim {dim} not found in view {list(in_shape)} -> {list(out_shape)}")


def view(node: Node, placements, axis_size: int) -> Decision:
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement):
        return _same_as_input(node, placements, source)
    if isinstance(placement, PackedShard):
        raise Unshardable("a packed value cannot be reshaped")
    in_shape, out_shape = shape_of(source), shape_of(node)
    if node.target is aten.unflatten.int:
        dim = _norm_dim(node.args[1], len(in_shape))
        count = len(node.args[2])
        if placement.dim < dim:
            out_dim = placement.dim
        elif placement.dim > dim:
            out_dim = placement.dim + count - 1
        else:
            out_dim = dim
            if out_shape[dim] % axis_size:
                _heads_do_not_split(node, axis_size)
                raise Unshardable(f"unflatten to {list(out_shape)} does not split over {axis_size} ranks")
    elif node.target is aten.flatten.using_ints:
        start, end = (_norm_dim(d, len(in_shape)) for d in (list(node.args[1:3]) + [0, -1][len(node.args) - 1:]))
        if placement.dim < start:
            out_dim = placement.dim
        elif placement.dim > end:
            out_dim = placement.dim - (end - start)
        elif placement.dim == start and (end == start or in_shape[start] % axis_size == 0):
            out_dim = start
        else:
            raise Unshardable(f"flatten({start}, {end}) mixes the sharded dim {placement.dim}")
    else:
        out_dim = _view_shard_dim(in_shape, out_shape, placement.dim, axis_size)
    return Decision(Shard(out_dim), {source: placement})


def _moves_dims(new_dim: Callable[[Node, int], int]) -> Callable:
    """The rule of a single-input op that only moves dims around: the shard follows its dim to ``new_dim``."""
    def rule(node: Node, placements, axis_size: int) -> Decision:
        source = node.args[0]
        placement = placements.get(source, R)
        if not is_sharded(placement):
            return _same_as_input(node, placements, source)
        return Decision(_with_dim(placement, new_dim(node, placement.dim)), {source: placement})
    rule.__doc__ = new_dim.__doc__
    return rule


@_moves_dims
def permute(node: Node, dim: int) -> int:
    """permute / transpose"""
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.permute.default:
        order = [_norm_dim(d, ndim) for d in node.args[1]]
    else:
        a, b = (_norm_dim(d, ndim) for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    return order.index(dim)


@_moves_dims
def unsqueeze(node: Node, dim: int) -> int:
    return dim + (_norm_dim(node.args[1], len(shape_of(node))) <= dim)


@_moves_dims
def squeeze(node: Node, dim: int) -> int:
    in_shape = shape_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [d for d, s in enumerate(in_shape) if s == 1]
    dims = [_norm_dim(d, len(in_shape)) for d in ([dims] if isinstance(dims, int) else dims)]
    return dim - sum(d < dim and in_shape[d] == 1 for d in dims)


@_moves_dims
def expand(node: Node, dim: int) -> int:
    return dim + len(shape_of(node)) - len(shape_of(node.args[0]))


def slice_like(node: Node, placements, axis_size: int) -> Decision:
    """slice / select / index_select / narrow along a dim other than the sharded one."""
    source = node.args[0]
    placement = placements.get(source, R)
    if not is_sharded(placement):
        return _same_as_input(node, placements, source)
    ndim = len(shape_of(source))
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    if dim == placement.dim:
        raise Unshardable(f"{node.target.__name__} along the sharded dim {dim}")
    out_dim = placement.dim - (node.target is aten.select.int and dim < placement.dim)
    return Decision(_with_dim(placement, out_dim), _same_as_input(node, placements, source).inputs)


def index_select(node: Node, placements, axis_size: int) -> Decision:
    """Rows picked by an index: a sharded index picks this rank's rows of a replicated table, locally (H3's
    per-row AdaLN parameters under sequence parallelism)."""
    source, dim, index = node.args[:3]
    if is_sharded(placements.get(index, R)):
        if is_sharded(placements.get(source, R)):
            raise Unshardable("index_select with both the table and the index sharded")
        return Decision(Shard(_norm_dim(dim, len(shape_of(source)))), {source: R, index: placements[index]})
    return slice_like(node, placements, axis_size)


# --- ops returning several tensors ------------------------------------------------------------------------------

def split(node: Node, placements, axis_size: int) -> Decision:
    """chunk / split / split_with_sizes / unbind. Splitting along the sharded dim needs a packed layout whose
    blocks are exactly the pieces: then each piece is a plain shard."""
    source = node.args[0]
    placement = placements.get(source, R)
    pieces = node.meta["val"]
    if not is_sharded(placement):
        return Decision(tuple(R for _ in pieces), _same_as_input(node, placements, source).inputs)
    ndim = len(shape_of(source))
    if node.target is aten.unbind.int:
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    else:
        dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
    if dim != placement.dim:
        out_dim = placement.dim - (node.target is aten.unbind.int and dim < placement.dim)
        return Decision(tuple(_with_dim(placement, out_dim) for _ in pieces), {source: placement})
    blocks = tuple(int(p.shape[dim]) for p in pieces)
    if isinstance(placement, PackedShard) and placement.blocks == blocks:
        return Decision(tuple(Shard(dim) for _ in pieces), {source: placement})
    if isinstance(placement, Shard) and len(blocks) > 1 and all(b % axis_size == 0 for b in blocks):
        raise NeedsPacking(source, blocks)
    raise Unshardable(f"split into {list(blocks)} along the sharded dim {dim} ({placement})")


def getitem(node: Node, placements, axis_size: int) -> Decision:
    source, index = node.args
    placement = placements.get(source, R)
    out = placement[index] if isinstance(placement, tuple) else R
    return Decision(out, {source: placement})


def _tensor_list_op(node: Node, placements) -> tuple[list[Node], int, dict[Node, object]]:
    """cat / stack: the tensors, the dim (normalised to the output's rank), the sharded inputs."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.args[0], _norm_dim(dim, len(shape_of(node))), _sharded_inputs(node, placements)


def cat(node: Node, placements, axis_size: int) -> Decision:
    tensors, dim, sharded = _tensor_list_op(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    if any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable("cat of packed values")
    dims = {p.dim for p in sharded.values()}
    if len(dims) != 1:
        raise Unshardable(f"cat of values sharded on different dims {sorted(dims)}")
    shard = dims.pop()
    inputs = {n: Shard(shard) for n in tensors}
    if shard != dim:
        return Decision(Shard(shard), inputs)
    blocks = tuple(shape_of(n)[dim] for n in tensors)
    if any(b % axis_size for b in blocks):
        raise Unshardable(f"cat along the sharded dim of blocks {list(blocks)} not divisible by {axis_size}")
    return Decision(PackedShard(dim, blocks), inputs)


def stack(node: Node, placements, axis_size: int) -> Decision:
    tensors, dim, sharded = _tensor_list_op(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    if len(set(sharded.values())) != 1 or any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable("stack of values sharded differently")
    placement = next(iter(sharded.values()))
    return Decision(Shard(placement.dim + (dim <= placement.dim)), {n: placement for n in tensors})


# --- ops with structure -----------------------------------------------------------------------------------------

def reduction(node: Node, placements, axis_size: int) -> Decision:
    """sum / mean / amax / amin over some dims: fine unless the sharded dim is one of them."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = _same_as_input(node, placements, source)
    if not is_sharded(placement):
        return decision
    ndim = len(shape_of(source))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(ndim)) if dims is None else [_norm_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if placement.dim in dims:
        raise Unshardable(f"{node.target.__name__} reduces over the sharded dim {placement.dim}")
    shift = 0 if keepdim else sum(d < placement.dim for d in dims)
    return Decision(_with_dim(placement, placement.dim - shift), decision.inputs)


def norm(node: Node, placements, axis_size: int) -> Decision:
    """rms_norm / layer_norm: fine unless the sharded dim is one of the normalised (last) dims."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = _same_as_input(node, placements, source)
    if is_sharded(placement):
        ndim = len(shape_of(source))
        if placement.dim >= ndim - len(node.args[1]):
            raise Unshardable(f"{node.target.__name__} normalises over the sharded dim {placement.dim}")
    return decision


def attention(node: Node, placements, axis_size: int) -> Decision:
    """scaled_dot_product_attention on (batch, heads, seq, head_dim): heads (and batch) may be sharded; q, k and v
    share the sharding; a replicated q/k/v is sliced to it."""
    q, k, v = node.args[:3]
    sharded = _sharded_inputs(node, placements)
    if not sharded:
        return replicate_all(node, placements)
    dims = {p.dim for n, p in sharded.items() if n in (q, k, v)}
    if len(dims) != 1 or any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable("query, key and value are sharded differently")
    dim = dims.pop()
    if dim not in (0, 1):
        raise Unshardable(f"attention over a sequence or head_dim sharded on dim {dim}")
    if dim == 1 and shape_of(k)[1] != shape_of(q)[1]:
        raise Unshardable("grouped-query attention (fewer key/value heads) is not sharded by heads yet")
    inputs = {n: Shard(dim) for n in (q, k, v)}
    for n in node.all_input_nodes:
        if n not in inputs:  # an attention mask broadcasts like a pointwise operand
            shape = shape_of(n)
            local = dim - (4 - len(shape))
            inputs[n] = R if local < 0 or shape[local] == 1 else Shard(local)
    return Decision(Shard(dim), inputs)


def make_linear_rule(roles: LinearRoles) -> Callable:
    def linear(node: Node, placements, axis_size: int) -> Decision:
        """y = x W^T + b. Sharded features in -> row-wise (W split on dim 1, output Partial). Replicated in ->
        column-wise if planned (W split on dim 0), row-wise if planned (x sliced locally), else replicated.
        Sharded rows (any other dim of x) pass through with a replicated weight."""
        x, weight = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else None
        px = placements.get(x, R)
        px = R if isinstance(px, Partial) else px
        ndim = len(shape_of(x))
        inputs = {x: px, weight: R}
        if bias is not None:
            inputs[bias] = R
        if (is_sharded(px) and px.dim == ndim - 1) or node in roles.rowwise:
            if node in roles.replicate or (node in roles.colwise and node in roles.forced):
                raise Unshardable(f"{'replicated' if node in roles.replicate else 'column-wise'} linear planned by "
                                  "the user receives sharded features")
            feature = px if is_sharded(px) and px.dim == ndim - 1 else Shard(ndim - 1)
            inputs[x] = feature
            inputs[weight] = _with_dim(feature, 1)
            return Decision(Partial(), inputs)
        if is_sharded(px):  # rows sharded (sequence parallel): each rank applies the whole weight to its rows
            return Decision(px, inputs)
        if node in roles.colwise:
            out_features = shape_of(weight)[0]
            if out_features % axis_size:
                _heads_do_not_split(node, axis_size)
                raise Unshardable(f"{out_features} output features do not split over {axis_size} ranks")
            blocks = roles.packed.get(node)
            placement = PackedShard(0, blocks) if blocks else Shard(0)
            inputs[weight] = placement
            if bias is not None:
                inputs[bias] = placement
            return Decision(_with_dim(placement, len(shape_of(node)) - 1), inputs)
        return Decision(R, inputs)
    return linear


def row_local_linear(node: Node, placements, axis_size: int) -> Decision:
    """Over a sequence axis a linear is applied row by row with the whole weight: rows may be sharded,
    features may not."""
    x = node.args[0]
    px = placements.get(x, R)
    if is_sharded(px) and px.dim == len(shape_of(x)) - 1:
        raise Unshardable("features sharded over a sequence-parallel axis")
    inputs = {n: R for n in node.all_input_nodes}
    inputs[x] = px
    return Decision(px, inputs)


def make_sequence_attention(axis: str) -> Callable:
    def sequence_attention(node: Node, placements, axis_size: int) -> Decision:
        """Ulysses: q/k/v sharded along the sequence are exchanged (all_to_all) to be sharded along heads, the
        attention runs over the whole sequence for this rank's heads, and the output goes back to sequence
        sharding. Heads or sequence lengths that do not divide the degree split unevenly; nothing is padded."""
        q, k, v = node.args[:3]
        sharded = _sharded_inputs(node, placements)
        if not any(n in sharded for n in (q, k, v)) or any(p.dim != 2 for p in sharded.values()):
            return attention(node, placements, axis_size)
        if len(node.all_input_nodes) > 3:
            raise Unshardable("sequence-parallel attention with a mask is not supported")
        if shape_of(k)[2] != shape_of(q)[2] or shape_of(k)[1] != shape_of(q)[1]:
            raise Unshardable("sequence-parallel attention needs self-attention with as many key as query heads")
        info = node.meta.get("heads")
        where = info.module if info is not None else node.name
        # More ranks than the heads a tp rank holds is correct but leaves ranks without heads; more ranks than
        # the model has heads is refused.
        # Too few heads or rows for the degree: this attention is left whole (the planner records why).
        heads = shape_of(q)[1]
        if heads < axis_size:
            raise Unshardable(f"{where}: {heads} attention heads cannot be spread over a {axis} degree of "
                              f"{axis_size} (at most {heads})")
        if shape_of(q)[2] < axis_size:
            raise Unshardable(f"{where}: a sequence of {shape_of(q)[2]} rows cannot be spread over a {axis} "
                              f"degree of {axis_size}")
        return Decision(Shard(1), {q: Shard(1), k: Shard(1), v: Shard(1)}, visible=Shard(2))
    return sequence_attention


def type_as(node: Node, placements, axis_size: int) -> Decision:
    # the second argument only lends its dtype
    return _same_as_input(node, placements, node.args[0], dont_care=(node.args[1],))


def creation_from(node: Node, placements, axis_size: int) -> Decision:
    # new_zeros & co. take only dtype and device from their input
    return Decision(R, {n: placements.get(n, R) for n in node.all_input_nodes})


def index_copy(node: Node, placements, axis_size: int) -> Decision:
    target, dim, index, source = node.args[:4]
    ndim = len(shape_of(node))
    dim = _norm_dim(dim, ndim)
    decision = pointwise_on(node, placements, (target, source))
    if is_sharded(decision.output) and decision.output.dim == dim:
        raise Unshardable("index_copy along the sharded dim")
    decision.inputs[index] = R
    return decision


def pointwise_on(node: Node, placements, operands) -> Decision:
    """Pointwise agreement between ``operands`` (all of the output's rank); other inputs replicated."""
    sharded = {n: placements[n] for n in operands if is_sharded(placements.get(n, R))}
    inputs = {n: R for n in node.all_input_nodes}
    if not sharded:
        return Decision(R, inputs)
    if len(set(sharded.values())) != 1:
        raise Unshardable("operands sharded differently")
    out = next(iter(sharded.values()))
    for n in operands:
        inputs[n] = out
    return Decision(out, inputs)


def scatter_into(node: Node, placements, axis_size: int) -> Decision:
    """slice_scatter / select_scatter (what functionalization makes of ``x[..., a:b] = y``): ``src`` is written
    into a slice of ``self`` along ``dim``. Along any other dim the two are sharded alike, row for row."""
    target, src, dim = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 0
    ndim = len(shape_of(node))
    dim = _norm_dim(dim, ndim)
    sharded = {n: placements[n] for n in (target, src) if is_sharded(placements.get(n, R))}
    inputs = {n: R for n in node.all_input_nodes}
    if not sharded:
        return Decision(R, inputs)
    if any(isinstance(p, PackedShard) for p in sharded.values()):
        raise Unshardable(f"{node.target.__name__} of a packed value")
    selected = node.target is aten.select_scatter.default  # src lacks ``dim``
    as_target = {target: placements.get(target, R)} if target in sharded else {}
    if src in sharded:
        src_dim = sharded[src].dim
        as_target[src] = Shard(src_dim + (selected and src_dim >= dim))
    dims = {p.dim for p in as_target.values()}
    if len(dims) != 1:
        raise Unshardable(f"{node.target.__name__} of values sharded on different dims {sorted(dims)}")
    out_dim = dims.pop()
    if out_dim == dim:
        raise Unshardable(f"{node.target.__name__} along the sharded dim {dim}")
    inputs[target] = Shard(out_dim)
    inputs[src] = Shard(out_dim - (selected and out_dim > dim))
    return Decision(Shard(out_dim), inputs)


def unary(node: Node, placements, axis_size: int) -> Decision:
    return _same_as_input(node, placements, node.args[0])


RULES: dict[object, Callable] = {
    aten.view.default: view,
    aten.reshape.default: view,
    aten._unsafe_view.default: view,
    aten.unflatten.int: view,
    aten.flatten.using_ints: view,
    aten.permute.default: permute,
    aten.transpose.int: permute,
    aten.unsqueeze.default: unsqueeze,
    aten.squeeze.dim: squeeze,
    aten.squeeze.dims: squeeze,
    aten.squeeze.default: squeeze,
    aten.expand.default: expand,
    aten.slice.Tensor: slice_like,
    aten.select.int: slice_like,
    aten.narrow.default: slice_like,
    aten.index_select.default: index_select,
    aten.chunk.default: split,
    aten.split.Tensor: split,
    aten.split_with_sizes.default: split,
    aten.unbind.int: split,
    aten.cat.default: cat,
    aten.stack.default: stack,
    aten.rms_norm.default: norm,
    aten.sum.dim_IntList: reduction,
    aten.mean.dim: reduction,
    aten.amax.default: reduction,
    aten.amin.default: reduction,
    aten.layer_norm.default: norm,
    aten.scaled_dot_product_attention.default: attention,
    aten.type_as.default: type_as,
    aten.new_zeros.default: creation_from,
    aten.new_ones.default: creation_from,
    aten.new_empty.default: creation_from,
    aten.new_full.default: creation_from,
    aten.zeros_like.default: unary,
    aten.ones_like.default: unary,
    aten.empty_like.default: unary,
    aten.full_like.default: unary,
    aten.index_copy.default: index_copy,
    aten.slice_scatter.default: scatter_into,
    aten.select_scatter.default: scatter_into,
    aten.copy.default: pointwise,  # self's shape, src's values broadcast into it
    aten.to.dtype: unary,
    aten.to.dtype_layout: unary,
    aten._to_copy.default: unary,
    aten.contiguous.default: unary,
    aten.dropout.default: unary,
    aten.alias.default: unary,
    aten.detach.default: unary,
}


def graph_output(node: Node, placements, axis_size: int) -> Decision:
    """The model returns full tensors."""
    if _sharded_inputs(node, placements):
        raise Unshardable("the graph output needs full tensors")
    return Decision(None, {n: R for n in node.all_input_nodes})


def rule_for(node: Node, roles: LinearRoles | None = None, sequence_axis: str | None = None) -> Callable:
    """The rule for ``node``: tensor-parallel linears by ``roles``, or, with ``sequence_axis`` (an axis name),
    the rules of a sequence-parallel axis (row-local linears, Ulysses attention)."""
    if node.op == "output":
        return graph_output
    target = node.target
    if getattr(getattr(target, "_schema", None), "is_mutable", False):
        return no_rule  # trace functionalizes; a write in place that is left is never carried
    if target is aten.linear.default:
        return row_local_linear if sequence_axis else make_linear_rule(roles)
    if target is aten.scaled_dot_product_attention.default and sequence_axis:
        return make_sequence_attention(sequence_axis)
    if target in RULES:
        return RULES[target]
    if target is operator.getitem:
        return getitem
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return pointwise
    return no_rule


def no_rule(node: Node, placements, axis_size: int) -> Decision:
    if _sharded_inputs(node, placements):
        raise Unshardable(f"{node.target} has no sharding rule")
    return replicate_all(node, placements)
