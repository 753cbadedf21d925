"""annotate_heads: find every attention, its projections and head reshapes; make head reshapes head_dim-based.

Requires: an exported aten graph with ``meta["val"]`` on every tensor node (global shapes).
Guarantees:
- every ``aten.scaled_dot_product_attention`` node, the reshapes that split its q/k/v into heads and merge its
  output back, and the linears that project q/k/v and the output, carry ``annotation.heads`` (a ``HeadInfo``);
- every head-splitting reshape of a non-empty value names ``head_dim`` and leaves the head count to be inferred
  (``-1``), so a rank that holds ``heads / tp`` heads reshapes into the right head_dim. (diffusers reshapes by the
  configured head count, ``unflatten(-1, (attn.heads, -1))``, which on a column shard silently yields
  ``head_dim / tp`` channels.)
The graph computes the same function as before: on full-size tensors both reshapes are identical.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch.fx import GraphModule, Node

from ..errors import InvariantError
from ..kinds import HeadRole
from ..rules import shape_of
from .context import PassContext
from ..annotations import annotation

aten = torch.ops.aten

# Ops a head-split tensor passes through between its reshape and attention (per-head norm, rotary, layout).
_HEAD_LOCAL = {
    aten.permute.default, aten.transpose.int, aten.rms_norm.default, aten.layer_norm.default, aten.contiguous.default,
    aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.clone.default, aten.cat.default,
    aten.slice.Tensor, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.chunk.default,
}
_RESHAPES = {aten.unflatten.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_MERGES = _RESHAPES | {aten.flatten.using_ints}
_PASS_THROUGH = {aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.dropout.default,
                 aten.clone.default, aten.type_as.default}


@dataclass(frozen=True)
class HeadInfo:
    attention: str  # name of the sdpa node
    module: str  # module path of the attention (from its output projection or q projection)
    heads: int
    head_dim: int
    role: HeadRole


def module_path(node: Node) -> str:
    """The innermost model module that made ``node`` (export's ``nn_module_stack``); "" for none, or the root."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _attention_module(attention: Node, q_proj: Node | None, out_proj: Node | None) -> str:
    """The attention module's path: the longest common prefix of its q and output projections' paths."""
    paths = [(module_path(n) or n.name).split(".") for n in (q_proj, out_proj) if n is not None]
    if not paths:
        return module_path(attention) or attention.name
    common = []
    for parts in zip(*paths) if len(paths) > 1 else [(p,) for p in paths[0][:-1]]:
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) or attention.name


def _is_head_split(node: Node, head_dim: int) -> bool:
    """A reshape of (..., heads * head_dim) into (..., heads, head_dim)."""
    out = shape_of(node)
    src = shape_of(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
    return (node.target in _RESHAPES and out is not None and src is not None and len(out) >= 2
            and out[-1] == head_dim and src[-1] == out[-2] * head_dim)


def _find_head_splits(value: Node, head_dim: int) -> list[Node]:
    """Walk back from an attention operand through head-local ops to the reshapes that split it into heads (several
    where streams are joined, as in Flux's joint attention), in graph order."""
    seen, stack, found = set(), [value], []
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, Node):
            continue
        seen.add(node)
        if _is_head_split(node, head_dim):
            found.append(node)
        elif node.target in _HEAD_LOCAL or node.target is operator.getitem:
            stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(value.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _producer_linear(node: Node) -> Node | None:
    while node.target in _PASS_THROUGH:
        node = node.args[0]
    return node if node.target is aten.linear.default else None


def _find_head_merge(attention: Node, heads: int, head_dim: int) -> tuple[Node | None, Node | None]:
    """Walk forward from the attention output to the reshape that merges heads, and the linear that consumes it."""
    node = attention
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None, None
        node = users[0]
        if node.target in _MERGES and shape_of(node) and shape_of(node)[-1] == heads * head_dim:
            merge = node
            while len(node.users) == 1 and next(iter(node.users)).target in _PASS_THROUGH:
                node = next(iter(node.users))
            consumer = next(iter(node.users)) if len(node.users) == 1 else None
            return merge, consumer if consumer is not None and consumer.target is aten.linear.default else None
        if node.target not in (aten.permute.default, aten.transpose.int, aten.contiguous.default):
            return None, None


def _head_dim_based(node: Node, heads: int, head_dim: int) -> None:
    """Rewrite a head split to infer the head count from head_dim; a split of an empty value (zero rows, as
    WanAnimate's face keys without a face) keeps its sizes: a -1 over zero elements is ambiguous, and localize
    names a sharded one's local sizes anyway."""
    if 0 in shape_of(node):
        return
    if node.target is aten.unflatten.int:
        node.args = (node.args[0], node.args[1], [-1, head_dim])
        return
    sizes = list(node.args[1])
    out = shape_of(node)
    sizes = [out[i] if s == -1 else s for i, s in enumerate(sizes)]  # static: any other -1 becomes concrete
    sizes[-2] = -1
    node.args = (node.args[0], sizes)


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for attention in [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]:
        q_shape = shape_of(attention.args[0])
        heads, head_dim = q_shape[-3], q_shape[-1]
        splits = {role: _find_head_splits(value, head_dim)
                  for role, value in zip((HeadRole.Q, HeadRole.K, HeadRole.V), attention.args[:3])}
        merge, out_proj = _find_head_merge(attention, heads, head_dim)
        q_proj = _producer_linear(splits["q"][0].args[0]) if splits["q"] else None
        module = _attention_module(attention, q_proj, out_proj)
        info = HeadInfo(attention.name, module, heads, head_dim, HeadRole.ATTENTION)
        annotation(attention).heads = info
        ctx.attention.append(info)
        for role, split in ((role, split) for role, found in splits.items() for split in found):
            split_heads = shape_of(split)[-2]
            annotation(split).heads = replace(info, heads=split_heads, role=role)
            _head_dim_based(split, split_heads, head_dim)
            projection = _producer_linear(split.args[0])
            if projection is not None:
                annotation(projection).heads = replace(info, heads=split_heads, role=role)
        if merge is not None:
            annotation(merge).heads = replace(info, role=HeadRole.MERGE)
        if out_proj is not None:
            annotation(out_proj).heads = replace(info, role=HeadRole.OUT)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: head splits of non-empty values infer the head count."""
    for node in gm.graph.nodes:
        info = annotation(node).heads
        if info is not None and info.role in (HeadRole.Q, HeadRole.K, HeadRole.V) and node.target in _RESHAPES:
            sizes = node.args[2] if node.target is aten.unflatten.int else node.args[1]
            if list(sizes)[-2:] != [-1, info.head_dim] and 0 not in shape_of(node):
                raise InvariantError(f"{node.name}: head split {sizes} is not head_dim-based")
