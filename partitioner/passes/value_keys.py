"""Keys for values that survive a retrace (``decisions.ValueKey``): a saved plan finds its values by what they are,
never by fx node names, which shift when an op is added anywhere before them.

A value's key is its module path, its op and its local signature: the roles of its operands (a weight by its path,
a user input by its argument name, a constant by its value, a computed value by its rank and dtype) and its own
rank and dtype; integer arguments by kind only (sizes change with the input shapes: a plan applies to a shape
specialisation). Two ways find it again, the first that holds:

1. its structure: a digest of the local signatures of its producers, ``depth`` levels up, the smallest depth that
   told it apart when the plan was made: exactly one value of this trace has it;
2. its place among the values alike (same module, op and local signature), when this trace has as many of them as
   the plan's (an op added in the same module, before it, changes neither: a hook's ``x * 1.0`` is not alike to
   the block's own products).

Anything else is refused naming the key: a plan never lands on another value because names or counts shifted.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch
from torch.fx import GraphModule, Node

from ..decisions import MAX_KEY_DEPTH as MAX_DEPTH
from ..decisions import ValueKey
from ..errors import PartitionError
from .annotate_heads import module_path


def op_name(node: Node) -> str:
    if node.op == "placeholder":
        return f"input {node.name}"
    if node.op == "get_attr":
        return f"attribute {node.target}"
    return _qualified(node.target)


def _qualified(target) -> str:
    """An op by its name, never by ``repr`` (a plain function prints its address, which differs between ranks)."""
    if isinstance(target, (str, torch._ops.OpOverload)):  # ("output", a method's name)
        return str(target)
    return torch.fx.node._get_qualified_name(target)


def _role(value) -> str:
    if isinstance(value, Node):
        if value.op == "placeholder":
            return value.name
        tensor = value.meta.get("val")
        return f"value({tensor.dim()}, {tensor.dtype})" if isinstance(tensor, torch.Tensor) else "value"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_role(v) for v in value) + ")"
    if isinstance(value, torch.device):  # by its type only: a plan made on meta applies to a trace on cuda
        return f"device {value.type}"
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return "int"
    if isinstance(value, (float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)):
        return repr(value)
    return _qualified(value) if callable(value) else type(value).__name__


def _local(node: Node) -> str:
    tensor = node.meta.get("val")
    own = f"{tensor.dim()}, {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
    return f"{own} = {_role(node.args)} {_role(sorted(node.kwargs.items()))}"


class _Signatures:
    """Memoised local signatures and structural digests of one graph's nodes."""

    def __init__(self, gm: GraphModule):
        self.locals: dict[Node, str] = {}
        self.digests: dict[tuple[Node, int], str] = {}
        self.places: dict[tuple[str, str], list[Node]] = {}
        for node in gm.graph.nodes:
            self.places.setdefault((module_path(node), op_name(node)), []).append(node)

    def local(self, node: Node) -> str:
        if node not in self.locals:
            self.locals[node] = hashlib.sha256(_local(node).encode()).hexdigest()[:16]
        return self.locals[node]

    def digest(self, node: Node, depth: int) -> str:
        key = (node, depth)
        if key not in self.digests:
            parts = [module_path(node), op_name(node), self.local(node)]
            if depth > 0:
                parts += [self.digest(producer, depth - 1) for producer in node.all_input_nodes]
            self.digests[key] = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        return self.digests[key]

    def alike(self, module: str, op: str, local: str) -> list[Node]:
        return [n for n in self.places.get((module, op), []) if self.local(n) == local]


def keys_of(gm: GraphModule, nodes) -> dict[Node, ValueKey]:
    signatures = _Signatures(gm)
    keys = {}
    for node in nodes:
        module, op, local = module_path(node), op_name(node), signatures.local(node)
        alike = signatures.alike(module, op, local)
        depth = next((d for d in range(MAX_DEPTH + 1) if sum(signatures.digest(n, d) == signatures.digest(node, d)
                                                             for n in alike) == 1), MAX_DEPTH)  # (else: by place)
        keys[node] = ValueKey(module, op, local, signatures.digest(node, depth), depth, alike.index(node), len(alike))
    return keys


def find(gm: GraphModule, keys, what: str) -> dict[ValueKey, Node]:
    """The node of each key; ``PartitionError`` naming every key (``what`` says whose) that this trace has no value
    for, by structure or by place."""
    keys = list(keys)
    signatures = _Signatures(gm)
    found, missing = {}, []
    for key in keys:
        alike = signatures.alike(key.module, key.op, key.signature)
        exact = [n for n in alike if signatures.digest(n, key.depth) == key.digest]
        if len(exact) == 1:
            found[key] = exact[0]
        elif len(alike) == key.alike and key.twin < len(alike):
            found[key] = alike[key.twin]
        else:
            missing.append(f"{key} ({len(alike)} values alike here, {key.alike} in the plan)" if alike else str(key))
    if missing:
        raise PartitionError(f"{what} name values this trace does not have: {'; '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                             + "; plan again for this model and these example input shapes")
    landed, given = Counter(found.values()), Counter(keys)
    twice = [key for key in found if landed[found[key]] > 1 or given[key] > 1]
    if twice:
        raise PartitionError(f"{what} find one value for several of their entries ({'; '.join(map(str, twice[:4]))}):"
                             " the plan is for another model or was edited; plan again")
    return found
