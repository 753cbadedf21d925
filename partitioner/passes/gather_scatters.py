"""gather_scatters: a sequence built by scattering rows (``index_copy``) is rewritten as a gather of rows, so that
under sequence parallelism each rank builds only the rows it owns.

MiniMax-H3 packs its text, video and audio rows into one sequence with ``index_copy`` at sequence-wide indices. An
index_copy cannot be split along the dim it writes (any rank's rows may come from any source row), so the whole
packed sequence used to be built on every rank and sliced afterwards: per-rank memory hardly fell with the
sequence degree. As a gather, each output row names the source row it reads::

    out = target.index_copy(d, index, source)
    # is, row for row:
    owner = full([S], -1).index_copy(0, index, arange(len(index)))   # which source row lands on each row (or -1)
    out = where(owner >= 0 (along d), source.index_select(d, owner.clamp(min=0)), target)

``owner`` is one integer per row (computed whole, cheap); everything else acts row by row, so the sequence rules
shard it (an index_select by a sharded per-row index picks this rank's rows locally). Then the row selection moves
towards the inputs through ops that act row by row (casts, linears, elementwise ops), so a rank projects its S/n
packed rows from the full (small) latent input instead of every latent row: H3's ``proj_in`` runs on this rank's
rows. (Each modality is projected for all S/n rows, those it does not own picking its row 0 and dropped by the
``where``: a static shape, at the cost of projecting rows a small modality does not fill.)

Every output row is the same source or target row as before; a projection moved after the selection computes
its rows in smaller matmuls, equal up to the reduction order of the matmul kernel. Duplicate indices (undefined
for index_copy) resolve as the inner ``index_copy`` resolves them. An index_copy from an empty source (a modality
absent from this call) writes nothing: it is replaced by its target.

Requires: pad_inputs (an index_copy that reads a bucket-padded dim is left alone: its reads are checked by name).
Guarantees: on a mesh with a sequence axis, no index_copy along a self-attention's sequence length feeds an
attention. Without a sequence axis the graph is unchanged.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..mesh import SEQUENCE_AXES
from ..rules import rule_for
from ..rules.pointwise import SAME_AS_INPUT
from ..rules.sequence_dims import find_sequence_dims
from .context import PassContext
from .plan_sequence import ancestors
from ..annotations import annotation, copied_meta

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default
_CASTS = set(SAME_AS_INPUT) - {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                               aten.full_like.default}


def _scatters(gm: GraphModule, ctx: PassContext) -> list[Node]:
    """The index_copy nodes along the rows of an attention they feed (not this pass's own per-row owner tables, nor
    one whose reads of a bucket-padded input are checked by name)."""
    attentions = [n for n in gm.graph.nodes if n.target is _ATTENTION]
    feeds = ancestors(attentions)
    model_tensors = {node for node, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    axis = next(axis for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES and ctx.mesh.size(axis) > 1)
    rows = find_sequence_dims(gm, lambda node: rule_for(node, sequence_axis=axis),
                              skip=model_tensors.__contains__)
    along = {}  # index_copy -> its dim, when that dim carries an attention's rows
    for node in reversed(gm.graph.nodes):
        if not _is_scatter(node) or node not in feeds:
            continue
        dim = node.args[1] % node.meta["val"].dim()
        # the rows an index_copy writes into are its output's (H3 writes text, video and audio rows in turn)
        if (rows.dim(node) == dim and node in rows.direct) or any(along.get(user) == dim for user in node.users
                                                                   if user.args[0] is node):
            along[node] = dim
    return [node for node in gm.graph.nodes if node in along and node.name not in ctx.padding_reads
            and not annotation(node).row_owners and node.args[2].meta["val"].dim() == 1]


def _is_scatter(node: Node) -> bool:
    return node.target is aten.index_copy.default


def _call(graph, target, args: tuple, kwargs: dict | None = None, like: Node | None = None, fake_mode=None,
          name: str | None = None) -> Node:
    """A new node computing ``target(*args, **kwargs)`` (named ``name`` in dumps), its value computed on fake
    tensors; ``like``'s other metadata (module path, stack trace), so that reports and plans name the module it
    belongs to."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    vals, kwvals = pytree.tree_map_only(Node, lambda n: n.meta["val"], (args, kwargs or {}))
    if fake_mode is None:
        fake_mode = next(v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)).fake_mode
    with fake_mode:
        val = target(*vals, **kwvals)
    if like is not None:
        node.meta.update({k: v for k, v in copied_meta(like).items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = val
    return node


def _as_gather(gm: GraphModule, scatter: Node) -> Node:
    """``scatter`` (an index_copy) rewritten as the gather above; returns the row selection from its source."""
    graph = gm.graph
    target, dim, index, source = scatter.args[:4]
    shape = scatter.meta["val"].shape
    dim = dim % len(shape)
    index_val = index.meta["val"]
    made = {"dtype": torch.int64, "device": index_val.device}
    # The per-row owners depend on the index alone: computed right where it is, so that a selection moved early
    # (``_select_early``) finds them defined.
    anchor = index if index.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(anchor):
        none = _call(graph, aten.full.default, ([shape[dim]], -1), made, like=scatter, fake_mode=index_val.fake_mode,
                     name="no_source_row")
    with graph.inserting_after(none):
        rows = _call(graph, aten.arange.default, (index_val.shape[0],), made, like=scatter,
                     fake_mode=index_val.fake_mode, name="source_rows")
    with graph.inserting_after(rows):
        owner = _call(graph, aten.index_copy.default, (none, 0, index, rows), like=scatter, name="source_row_of")
        annotation(owner).row_owners = True
    with graph.inserting_after(owner):
        take = _call(graph, aten.clamp_min.default, (owner, 0), like=scatter, name="rows_to_pick")
    with graph.inserting_before(scatter):
        found = _call(graph, aten.ge.Scalar, (owner, 0), like=scatter, name="written")
        mask = _call(graph, aten.reshape.default,
                     (found, [shape[dim] if d == dim else 1 for d in range(len(shape))]), like=scatter,
                     name="written_rows")
        picked = _call(graph, aten.index_select.default, (source, dim, take), like=scatter, name="picked_rows")
        gathered = _call(graph, aten.where.self, (mask, picked, target), like=scatter, name="gathered")
    scatter.replace_all_uses_with(gathered)
    graph.erase_node(scatter)
    return picked


def _select_early(gm: GraphModule, select: Node) -> None:
    """Move ``select`` (an index_select of rows) before the ops that compute its input row by row, as long as the
    selection is their only use: the rows not selected are then never computed."""
    graph = gm.graph
    while True:
        value, dim, index = select.args
        if value.op != "call_function" or len(value.users) != 1:
            return
        if any(isinstance(leaf, Node) for leaf in pytree.tree_leaves(value.kwargs)):
            return  # (a tensor passed by keyword: not rewired below)
        ndim = value.meta["val"].dim()
        dim = dim % ndim
        if value.meta["val"].shape[dim] == 1:
            return  # one row: an operand of size 1 there would be taken for a broadcast one
        if value.target in _CASTS or (value.target is aten.linear.default and dim != ndim - 1):
            operands = {value.args[0]: dim}
        elif torch.Tag.pointwise in getattr(value.target, "tags", ()):
            operands = {}
            for arg in value.all_input_nodes:  # broadcast operands (size 1 or missing along dim) stay whole
                arg_shape = arg.meta["val"].shape
                arg_dim = dim - (ndim - len(arg_shape))
                if arg_dim >= 0 and arg_shape[arg_dim] != 1:
                    operands[arg] = arg_dim
        else:
            return
        with graph.inserting_before(select):  # computed where used: one modality's rows alive at a time
            selected = {arg: _call(graph, aten.index_select.default, (arg, arg_dim, index), like=select,
                                   name="picked_rows") for arg, arg_dim in operands.items()}
            args = pytree.tree_map_only(Node, lambda n: selected.get(n, n), value.args)
            moved = _call(graph, value.target, args, value.kwargs, like=value)
        select.replace_all_uses_with(moved)
        graph.erase_node(select)
        graph.erase_node(value)
        if len(selected) != 1:
            return
        select = next(iter(selected.values()))


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if not any(ctx.mesh.size(axis) > 1 for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES):
        return gm
    for scatter in _scatters(gm, ctx):
        target, dim, _, source = scatter.args[:4]
        if source.meta["val"].shape[dim] == 0:  # writes nothing (and index_select cannot pick from no rows)
            scatter.replace_all_uses_with(target)
            gm.graph.erase_node(scatter)
            continue
        _select_early(gm, _as_gather(gm, scatter))
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: on a sequence-parallel mesh no index_copy along a sequence length feeds an attention."""
    if any(ctx.mesh.size(axis) > 1 for axis in ctx.mesh.axis_names if axis in SEQUENCE_AXES):
        left = [n.name for n in _scatters(gm, ctx)]
        if left:
            raise InvariantError(f"index_copy along a sequence length left: {left}")
