"""narrow_indices: int64 index tensors whose values provably fit become int32 (Neuron computes indices in int32).

Not part of ``PIPELINE``: the Neuron backend runs it on its copy of a rank's graph (``run(gm) -> gm``, in place).

"Provably fits": an int64 value whose every use is as indices, directly or through ops that only move or pick its
values (views, slices), keeps its meaning in int32: no arithmetic, promotion or output sees the narrower type. Its
values fit because they are checked: it is narrowed where it is made,
- a graph input (user input, host-prologue transfer): its placeholder becomes int32, and ``cast_inputs`` casts the
  int64 argument at each call after checking its range (a value outside int32 was no valid index anyway; the error
  names the input; a tensor passed again, a model buffer, is checked once), so the narrowed graph sees exactly the
  values the original saw;
- ``arange`` with static bounds inside int32: made int32 directly.
Anything computed by arithmetic (H3's ``timestep_indices * 3 + token_tags``) stays int64, and so do the inputs it
reads: int32 arithmetic could wrap an invalid index into a valid one.

Index uses are those CPU computes identically with int32 indices (torch 2.13; checked against int64 with
contiguous, strided and expanded indices): index_select, index_add, index.Tensor, index_put, embedding. Not used:
index_fill and take refuse int32 ("Expected a long tensor"); gather accepts int32 but returns wrong rows for a
non-contiguous int32 index (an expanded one, as models build them), so gather and scatter keep int64.
index_copy refuses int32 too, but it is how H3 builds the packed sequence, so an index_copy whose index is
narrowed becomes the index_put it equals for valid indices (``x.index_copy(d, i, s)`` is ``x[(:,) * d + (i,)] =
s``); index_put would wrap a negative index that index_copy refuses, so the input check refuses it instead.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from ..errors import InputError
from ..annotations import annotation

aten = torch.ops.aten
INT32 = torch.iinfo(torch.int32)
_DIM_INDEX = {aten.index_select.default, aten.index_add.default, aten.index_copy.default}  # (self, dim, index, ...)
_INDEX_LISTS = {aten.index.Tensor, aten.index_put.default}  # (self, [indices per dim], ...)
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# Ops whose output holds only values of their first input.
_MOVES = {aten.slice.Tensor, aten.select.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default, aten.permute.default,
          aten.flatten.using_ints, aten.unflatten.int, aten.clone.default, aten.contiguous.default, aten.alias.default}


def _index_operands(user: Node) -> list[tuple[Node, int]]:
    """The tensors ``user`` takes as indices, each with the size of the dimension it indexes."""
    shape = user.args[0].meta["val"].shape if user.args and isinstance(user.args[0], Node) else ()
    if user.target in _DIM_INDEX and user.args[2].meta["val"].dim() == 1:
        return [(user.args[2], shape[user.args[1]])]
    if user.target is aten.embedding.default:
        return [(user.args[1], shape[0])]
    if user.target in _INDEX_LISTS:  # (a boolean mask before an index shifts the dim it indexes: take the largest)
        size = max(shape) if all(isinstance(s, int) for s in shape) else None
        return [(index, size) for index in user.args[1] if isinstance(index, Node)]
    return []


def _only_indexes(node: Node, memo: dict) -> bool:
    """Every use of ``node``'s values is as indices into a static dimension that int32 can address."""
    if node not in memo:
        memo[node] = bool(node.users) and all(_used_as_index(node, user, memo) for user in node.users)
    return memo[node]


def _used_as_index(node: Node, user: Node, memo: dict) -> bool:
    if user.target in _MOVES and user.args[0] is node and node not in pytree.tree_leaves((user.args[1:], user.kwargs)):
        return _only_indexes(user, memo)
    operands = _index_operands(user)
    uses = pytree.tree_leaves((user.args, user.kwargs)).count(node)
    return uses == sum(operand is node and isinstance(size, int) and size <= INT32.max for operand, size in operands)


def _narrow(node: Node, root: Node) -> None:
    """Mark ``node`` and the moves downstream of it int32, and turn the index_copy they feed into index_put."""
    node.meta["val"] = node.meta["val"].to(torch.int32)
    for user in list(node.users):
        if user.target in _MOVES:
            _narrow(user, root)
        elif user.target is aten.index_copy.default:
            self, dim, index, source = user.args
            user.target = aten.index_put.default
            user.args = (self, [None] * (dim % self.meta["val"].dim()) + [index], source)
            # index_copy refuses a negative index, index_put wraps it: the input check keeps the refusal
            annotation(root).nonnegative = user.name


def run(gm: GraphModule) -> GraphModule:
    memo = {}
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.int64 or not _only_indexes(node, memo):
            continue
        if node.op == "placeholder":
            annotation(node).narrowed_from = torch.int64  # cast_inputs casts this argument at each call
        elif node.target in _ARANGES and all(isinstance(a, int) and INT32.min <= a <= INT32.max for a in node.args):
            node.update_kwarg("dtype", torch.int32)
        else:
            continue
        _narrow(node, node)
    return gm


def cast_inputs(fn, gm: GraphModule):
    """``fn`` (``gm`` lowered) called with ``gm``'s inputs as they were before narrowing: each narrowed int64
    argument is checked to fit int32 and cast. An argument passed again as the same, unchanged tensor (a model
    buffer) is checked and cast once."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    narrowed = [(i, node.name, annotation(node).nonnegative) for i, node in enumerate(placeholders)
                if annotation(node).narrowed_from is not None]
    if not narrowed:
        return fn
    last: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # index -> (argument, its version, cast)

    def cast(args) -> list:
        args = list(args)
        for i, name, nonnegative in narrowed:
            if i in last and last[i][0] is args[i] and last[i][1] == args[i]._version:  # unchanged since
                args[i] = last[i][2]
                continue
            narrow = to_int32(args[i], name, nonnegative)
            last[i] = (args[i], args[i]._version, narrow)
            args[i] = narrow
        return args

    def call(*args):
        return fn(*cast(args))

    # The runtime checks (and casts) the inputs before a call's first collective, so that a rank that refuses
    # its inputs refuses with every rank; the call then finds the casts done.
    call.check_inputs = lambda *args: cast(args) and None
    return call


def to_int32(value: torch.Tensor, name: str, nonnegative: str | None = None) -> torch.Tensor:
    if value.numel():
        low, high = (int(v) for v in value.aminmax())
        if low < INT32.min or high > INT32.max:
            raise InputError(f"{name} holds values in [{low}, {high}], outside int32: it is used only as indices, "
                             "which the Neuron graph takes as int32, and no valid index lies outside int32")
        if nonnegative and low < 0:
            raise InputError(f"{name} holds a negative index ({low}); {nonnegative} (an index_copy) refuses it")
    return value.to(torch.int32)
