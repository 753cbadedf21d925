"""localize: turn the global graph into this rank's graph.

Requires: insert_collectives has run (every edge is placed as required).
Guarantees:
- every parameter, buffer or constant placed sharded has a slicing spec in ``ctx.slice_specs`` (FQN ->
  {axis: placement}), the only place the loader learns how to cut it;
- every op that names sizes (view, reshape, unflatten, expand, new_zeros, full) names this rank's sizes, a grouped
  convolution this rank's groups, and views are reshapes
  (the trace's strides do not hold once collectives lay values out);
- a flex_attention whose heads (or batch) are split reads global indices: its score_mod and mask_mod get this
  rank's first head (batch) added to the index they read;
- ``meta["val"]`` holds this rank's shapes, recomputed by fake-tensor propagation, and agrees with every node's
  placement: a dim sharded over an axis of size n is 1/n of the global dim (checked). ``annotation.global_shape``
  keeps the global one.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..placement import PackedShard, is_sharded, local_shape, shard_slices, split_order
from ..rules.attention import FLEX_ATTENTION, FLEX_MASK_INDEX, FLEX_SCORE_INDEX
from ..rules.conv import GROUPS_ARGUMENT, groups_of
from ..rules.pointwise import SIZE_ARGUMENT
from ..rules.spatial import NEAREST
from ..rules.views import block_range
from ..runtime import collectives
from .context import PassContext
from .insert_collectives import rekey
from .regions import propagate_fake_values
from ..annotations import annotation, copied_meta

aten = torch.ops.aten
_SIZED_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _shape(val):
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(val, (tuple, list)):
        return tuple(_shape(v) for v in val)
    return None


def _expected_local(node: Node, mesh):
    shape, placements = annotation(node).global_shape, annotation(node).placements
    if shape is None or not shape or not isinstance(shape[0], tuple):
        return tuple(local_shape(shape, placements, mesh)) if shape is not None else None
    per_output = [{axis: p[i] if isinstance(p, tuple) else p for axis, p in placements.items()}
                  for i in range(len(shape))]
    return tuple(tuple(local_shape(s, p, mesh)) if s is not None else None for s, p in zip(shape, per_output))


def _split_dim(node: Node) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return dim % len(annotation(node.args[0]).global_shape)


def _localize_sizes(node: Node, mesh) -> None:
    placements = annotation(node).placements
    if node.target in (aten.view.default, aten._unsafe_view.default):
        # A view is legal for the strides the trace saw; a collective's result is laid out its own way (an
        # all_to_all's output is contiguous in another order), so a rank's view may need a copy: reshape decides.
        node.target = aten.reshape.default
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default):
        # pieces of a packed shard are this rank's parts of each block: name their local sizes
        dim = _split_dim(node)
        node.target = aten.split_with_sizes.default
        node.args = (node.args[0], [shape[dim] for shape in _expected_local(node, mesh)], dim)
        node.kwargs = {}
        return
    if not any(is_sharded(p) for p in placements.values()):
        return
    if node.target is collectives.all_to_all_wait:  # the shape it joins: this rank's part of what was sent
        node.args = (node.args[0], list(_expected_local(node.args[0].args[0], mesh)), *node.args[2:])
    elif node.target in (aten.slice.Tensor, aten.slice_scatter.default):
        _localize_block_slice(node, mesh)
    elif node.target in _SIZED_VIEWS:
        node.args = (node.args[0], _expected_local(node, mesh))
    elif node.target in SIZE_ARGUMENT:  # a tensor made sharded (a sequence buffer): made at this rank's size
        index = SIZE_ARGUMENT[node.target]
        node.args = (*node.args[:index], list(_expected_local(node, mesh)), *node.args[index + 1:])
    elif node.target is aten.unflatten.int:  # named sizes become local, an inferred (-1) one stays inferred
        dim, split = node.args[1], list(node.args[2])
        dim = dim % len(annotation(node.args[0]).global_shape)
        local = _expected_local(node, mesh)[dim:dim + len(split)]
        node.args = (node.args[0], node.args[1], [-1 if s == -1 else size for s, size in zip(split, local)])
    elif node.target in GROUPS_ARGUMENT and groups_of(node) > 1:  # a rank convolves its channels' groups
        index, source = GROUPS_ARGUMENT[node.target], node.args[0]
        groups = groups_of(node) * _expected_local(source, mesh)[1] // annotation(source).global_shape[1]
        if len(node.args) > index:
            node.args = (*node.args[:index], groups, *node.args[index + 1:])
        else:  # (export passes it positionally; a keyword is kept a keyword)
            node.kwargs = {**node.kwargs, "groups": groups}
    elif node.target in (aten.pad.default, aten.constant_pad_nd.default):  # a rank pads its part of the new rows
        widths, ndim = list(node.args[1]), len(annotation(node.args[0]).global_shape)
        for d, (out, source) in enumerate(zip(_expected_local(node, mesh), _expected_local(node.args[0], mesh))):
            before = 2 * (ndim - 1 - d)  # (pad's widths run from the last dim: before, after)
            if before + 1 < len(widths) and out - source != widths[before] + widths[before + 1]:
                widths[before if widths[before] else before + 1] = out - source
        node.args = (node.args[0], widths, *node.args[2:])
    elif node.target in NEAREST and len(node.args) > 1 and node.args[1] is not None:  # F.interpolate(size=...)
        node.args = (node.args[0], list(_expected_local(node, mesh)[-NEAREST[node.target]:]), *node.args[2:])
    elif node.target is aten.expand.default:
        local = _expected_local(node, mesh)
        node.args = (node.args[0], [s if s == -1 else local[i] for i, s in enumerate(node.args[1])])


def _localize_block_slice(node: Node, mesh) -> None:
    """A slice (or slice_scatter) over whole blocks of a packed shard (the image rows of a joint text + image
    sequence) covers this rank's part of those blocks: their local offsets."""
    source = node.args[0]
    if annotation(node).local_slice:  # a slice insert_collectives took of this rank's part of its input
        return
    dim_arg = 2 if node.target is aten.slice_scatter.default else 1
    dim = (node.args[dim_arg] if len(node.args) > dim_arg else 0) % len(annotation(source).global_shape)
    packed = [(axis, p) for axis, p in annotation(source).placements.items()
              if isinstance(p, PackedShard) and p.dim == dim]
    if not packed:
        return
    (axis, placement), = packed
    if any(is_sharded(p) and p.dim == dim for other, p in annotation(source).placements.items() if other != axis):
        raise InvariantError(f"{node.name}: a block slice of a dim sharded over two axes")
    first, last = block_range(node, placement, dim_arg)
    # this rank's width of each block (uneven blocks, in whole units, differ from rank to rank)
    local = [end - start for start, end in shard_slices(placement, sum(placement.blocks), mesh.size(axis),
                                                        mesh.coordinate(axis))]
    node.args = (*node.args[:dim_arg], dim, sum(local[:first]), sum(local[:last]))


def _first_index(node: Node, dim: int, mesh) -> int:
    """The global index of this rank's first element along ``dim`` of ``node``'s first output, under its
    placements (axes in split order, each splitting what the ones before it left)."""
    placements = {axis: p[0] if isinstance(p, tuple) else p for axis, p in annotation(node).placements.items()}
    size, first = annotation(node).global_shape[0][dim], 0
    for axis in split_order(placements, mesh):
        placement = placements.get(axis)
        if is_sharded(placement) and placement.dim == dim:
            (start, end), = shard_slices(placement, size, mesh.size(axis), mesh.coordinate(axis))
            first, size = first + start, end - start
    return first


def _shifted(module: GraphModule, shifts: dict[int, int]) -> GraphModule:
    """A copy of a score_mod / mask_mod graph whose index arguments (placeholder position -> shift) are shifted."""
    shifted = GraphModule(module, copy.deepcopy(module.graph))
    placeholders = [n for n in shifted.graph.nodes if n.op == "placeholder"]
    for position, shift in shifts.items():
        index = placeholders[position]
        with shifted.graph.inserting_after(placeholders[-1]):
            moved = shifted.graph.call_function(aten.add.Tensor, (index, shift))
        index.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    shifted.recompile()
    return shifted


def _globalize_flex_indices(gm: GraphModule, node: Node, mesh) -> None:
    """flex_attention's score_mod and mask_mod number heads and batch globally; on this rank's shard of them
    they count from this rank's first head (batch) on."""
    firsts = {dim: _first_index(node, dim, mesh) for dim in (0, 1)}
    block_mask = node.args[4]
    replaced = []
    for graph_node, positions in ((node.args[3], FLEX_SCORE_INDEX), (block_mask[-1], FLEX_MASK_INDEX)):
        shifts = {positions[dim]: first for dim, first in firsts.items() if first}
        if not shifts:
            replaced.append(graph_node)
            continue
        name = f"{graph_node.target}_from_{'_'.join(str(firsts[d]) for d in (0, 1))}"
        if not hasattr(gm, name):
            gm.add_submodule(name, _shifted(getattr(gm, graph_node.target), shifts))
        with gm.graph.inserting_before(node):
            shifted = gm.graph.get_attr(name)
        annotation(shifted).placements = dict(annotation(graph_node).placements)
        rekey(node, graph_node, shifted)  # (read whole, as the subgraph it replaces)
        replaced.append(shifted)
    node.args = (*node.args[:3], replaced[0], (*block_mask[:-1], replaced[1]), *node.args[5:])


def _flex_without_work(gm: GraphModule, node: Node, mesh) -> bool:
    """A rank left without heads (more Ulysses ranks than a tp rank's heads: TP=8 x Ulysses=8 over 56 heads) or
    without batch rows has nothing to attend: flex_attention, which divides by the head count, is not run, and its
    outputs are empty tensors of this rank's shape (the exchanges around it still take part)."""
    queries = node.args[0]
    if all(_expected_local(queries, mesh)[:2]):
        return False
    for output in list(node.users):
        with gm.graph.inserting_before(output):
            empty = gm.graph.call_function(aten.new_zeros.default, (queries, _expected_local(output, mesh)),
                                           {"dtype": output.meta["val"].dtype})
        empty.meta = copied_meta(output)
        annotation(empty).required = {axis: {queries: annotation(queries).placements[axis]}
                                      for axis in annotation(output).required}
        for user in list(output.users):  # (their requirements follow the value they now read)
            rekey(user, output, empty)
        output.replace_all_uses_with(empty)
        gm.graph.erase_node(output)
        empty.name = output.name  # (ranks compare their collectives by the names of the values they move)
    gm.graph.erase_node(node)
    return True


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    mesh = ctx.mesh
    for node in gm.graph.nodes:
        # (a collective's buffer in flight is shaped as the collective moves it: no global value it is a part of)
        annotation(node).global_shape = None if annotation(node).in_flight else _shape(node.meta.get("val"))
    for node, graph_input in ctx.placeholder_inputs(gm).items():
        sharded = {axis: p for axis, p in annotation(node).placements.items() if is_sharded(p)}
        if sharded and graph_input.is_model_tensor:
            ctx.slice_specs[graph_input.target] = sharded
    for node in gm.graph.nodes:
        if node.op == "call_function":
            _localize_sizes(node, mesh)
    for node in [n for n in gm.graph.nodes if n.target is FLEX_ATTENTION]:
        if not _flex_without_work(gm, node, mesh):
            _globalize_flex_indices(gm, node, mesh)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_inputs = [torch.empty(_expected_local(n, mesh), dtype=n.meta["val"].dtype, device=n.meta["val"].device)
                       if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
                       for n in gm.graph.nodes if n.op == "placeholder"]
    propagate_fake_values(gm, mode, fake_inputs, shape_of=lambda node: _expected_local(node, mesh))
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every value's per-rank shape is its global shape cut by its placements."""
    for node in gm.graph.nodes:
        if node.op == "output" or annotation(node).global_shape is None:
            continue
        expected, actual = _expected_local(node, ctx.mesh), _shape(node.meta.get("val"))
        if expected != actual:
            raise InvariantError(f"{node.name}: local shape {actual} but placements "
                                 f"{annotation(node).placements} of {annotation(node).global_shape} imply {expected}")
