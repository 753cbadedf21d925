"""matmul / bmm / mm / baddbmm: a shard follows the dim it names in the product.

``a @ b`` with ``a [..., n, k]`` and ``b [..., k, m]`` (batch dims broadcast, right-aligned):
- a batch dim sharded: every batch entry is its own product; the other operand is cut alike (a local slice when it
  is whole) and the output is sharded along that batch dim (heads of a linear attention spelled out as matmuls);
- ``a``'s rows sharded, ``b`` whole: the output's rows; ``b``'s columns sharded, ``a`` whole: the output's columns;
- the contracted dim ``k`` sharded (in both, alike, or in one with the other cut locally): each rank sums its
  part of ``k``, the output is Partial and reduced where it is consumed (a linear attention's ``v^T k`` over
  sequence-sharded rows: one all_reduce of a ``[heads, d, d]`` state instead of exchanging the sequence).
Anything else (both operands sharded along different roles, a vector operand) is Unshardable.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..placement import Partial, Shard, is_sharded
from .core import Decision, R, Unshardable, register, shape_of, with_dim

aten = torch.ops.aten


def _role(placement, ndim: int, out_ndim: int, first: bool) -> tuple[str, int]:
    """What a sharded dim of an operand is in the product: ("batch", output dim), ("rows"|"cols", output dim) or
    ("contract", -1)."""
    dim = placement.dim
    if dim < ndim - 2:
        return "batch", dim + out_ndim - ndim
    if (dim == ndim - 1) == first:
        return "contract", -1
    return ("rows", out_ndim - 2) if first else ("cols", out_ndim - 1)


def _operand_dim(role: tuple[str, int], ndim: int, out_ndim: int, first: bool) -> int | None:
    """The dim of an operand of ``ndim`` dims that plays ``role``; None when the operand has no such dim."""
    kind, out_dim = role
    if kind == "contract":
        return ndim - 1 if first else ndim - 2
    if kind == "batch":
        dim = out_dim - out_ndim + ndim
        return dim if dim >= 0 else None
    return None


@register(aten.matmul.default, aten.bmm.default, aten.mm.default)
def matmul(node: Node, placements, axis_size: int) -> Decision:
    return _product(node, *node.args[:2], placements)


@register(aten.baddbmm.default)
def baddbmm(node: Node, placements, axis_size: int) -> Decision:
    """``beta * input + alpha * (batch1 @ batch2)`` (diffusers' classic attention scores, its mask the input): the
    product shards as bmm's, the input is cut alike where it has the output's sharded dim (right-aligned; of size
    one it broadcasts and stays whole). A split contracted dim is refused: every rank would add the input to its
    partial product."""
    added, first, second = node.args[:3]
    decision = _product(node, first, second, placements)
    if isinstance(decision.output, Partial):
        raise Unshardable("baddbmm with its contracted dim sharded")
    if not isinstance(added, Node):
        return decision
    shape = shape_of(added) or ()
    dim = decision.output.dim - (len(shape_of(node)) - len(shape)) if is_sharded(decision.output) else -1
    return Decision(decision.output, {**decision.inputs, added: with_dim(decision.output, dim)
                                      if dim >= 0 and shape[dim] > 1 else R})


def _product(node: Node, a: Node, b: Node, placements) -> Decision:
    pa, pb = (placements.get(n, R) for n in (a, b))
    pa, pb = (R if isinstance(p, Partial) else p for p in (pa, pb))  # a partial operand is reduced first
    if not (is_sharded(pa) or is_sharded(pb)):
        return Decision(R, {a: R, b: R})
    shapes = shape_of(a), shape_of(b), shape_of(node)
    if min(len(shapes[0]), len(shapes[1])) < 2:
        raise Unshardable("a matrix-vector product with a sharded operand")
    (na, nb), out_ndim = (len(shapes[0]), len(shapes[1])), len(shapes[2])
    roles = {_role(p, n, out_ndim, first) for p, n, first in ((pa, na, True), (pb, nb, False)) if is_sharded(p)}
    if len(roles) > 1:
        raise Unshardable(f"matmul operands sharded along different roles ({a.name} {pa} @ {b.name} {pb})")
    (role,) = roles
    sharded = pa if is_sharded(pa) else pb
    dims = _operand_dim(role, na, out_ndim, True), _operand_dim(role, nb, out_ndim, False)
    inputs = {a: pa, b: pb}
    for operand, placement, dim, shape in ((a, pa, dims[0], shapes[0]), (b, pb, dims[1], shapes[1])):
        if is_sharded(placement):  # (rows and columns are each one operand's: never both sharded)
            if dim is not None and placement != with_dim(sharded, dim):
                raise Unshardable(f"matmul operands cut differently along their {role[0]} dim ({a.name} {pa} @ {b.name} "
                                  f"{pb})")
        elif dim is not None and (shape[dim] != 1 or role[0] == "contract"):
            inputs[operand] = with_dim(sharded, dim)  # the whole operand is cut locally to match
    if role[0] == "contract":
        return Decision(Partial(), inputs)
    if role[0] == "batch" and any(is_sharded(p) and shapes[2][role[1]] != shape[dim] for p, dim, shape in
                                  ((pa, dims[0], shapes[0]), (pb, dims[1], shapes[1]))):
        raise Unshardable(f"matmul broadcasts the sharded batch dim {sharded.dim}")
    return Decision(with_dim(sharded, role[1]), inputs)


@register(aten.einsum.default)
def einsum(node: Node, placements, axis_size: int) -> Decision:
    """einsum with an explicit output (``"nd,dhf->nhf"``: Mochi's rotary angles from positions): a shard follows its
    index letter. Every operand with that letter is cut alike (a whole one locally; one of size 1 there broadcasts
    and stays whole); the output is cut along the letter, or Partial when the letter is summed over."""
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    placed = [R if isinstance(placements.get(n, R), Partial) else placements.get(n, R) for n in operands]
    if not any(is_sharded(p) for p in placed):
        return Decision(R, {n: R for n in operands})
    if "..." in equation or "->" not in equation:
        raise Unshardable("einsum with an ellipsis or an implicit output")
    terms, out = equation.split("->")
    terms = terms.split(",")
    if any(len(set(term)) != len(term) for term in terms) or any(type(p) is not Shard and is_sharded(p)
                                                                 for p in placed):
        raise Unshardable("einsum with a repeated index or a packed shard")
    letters = {term[p.dim] for term, p in zip(terms, placed) if is_sharded(p)}
    if len(letters) != 1:
        raise Unshardable(f"einsum operands sharded along different indices {sorted(letters)}")
    (letter,) = letters
    inputs = {}
    for operand, term, placement in zip(operands, terms, placed):
        wanted = Shard(term.index(letter)) if letter in term and shape_of(operand)[term.index(letter)] != 1 else R
        if is_sharded(placement) and placement != wanted or inputs.get(operand, wanted) != wanted:
            raise Unshardable(f"einsum operand {operand.name} cut otherwise than along {letter!r}")
        inputs[operand] = wanted
    return Decision(Shard(out.index(letter)) if letter in out else Partial(), inputs)
