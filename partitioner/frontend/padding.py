"""Padding that never changes a result: the proof, and the buckets a padded input dim is served at.

Two kinds of values are padded to a static size: the host prologue's data-dependent results (``hoist_host``) and
user inputs the caller names in ``partition(..., buckets=...)`` (``pad_inputs``), e.g. a timestep table with 1 to 4
rows. ``follow_padding`` proves the padding rows are never read into a result.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from ..errors import InputError
from ..placement import PackedShard, Replicate, Shard, any_sharded
from ..rules import PartitionError, Unshardable, rule_for
from .trace import argument_name

aten = torch.ops.aten


def follow_padding(gm: GraphModule, padded: dict[Node, int], trims: set[tuple[int, int]] = frozenset(),
                   what: dict[Node, str] | None = None) -> dict[Node, Node]:
    """Padding rows must never change a result. A padded dim is followed like a sequence shard, with the same
    rules (ops that treat rows one by one carry it; views keep it outermost); it may end only where rows are picked
    by index along it (``index_select``, or ``x[index]``: valid indices never point at padding, which sits at the
    end). Anything else that reaches it (a reduction over it, a matmul contracting it, attention, a concatenation
    along it, the graph output unless that output is trimmed back to its real size) would mix padding into results:
    ``PartitionError`` naming the op. Returns each indexing node that ends a padded dim -> the padded value it
    picks from (its index must stay below the real rows: ``Preflight`` checks that per call)."""
    placements = {node: Shard(dim) for node, dim in padded.items()}
    origin = dict.fromkeys(padded)
    origin.update({node: node for node in padded})
    readers: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        reads = [n for n in node.all_input_nodes if any_sharded(placements.get(n, Replicate()))]
        if node.op == "placeholder" or not reads:
            continue
        if node.op == "output" and all((node.args[0].index(n), placements[n].dim) in trims for n in reads):
            continue
        if _picks_rows_along(node, reads, placements):
            readers[node] = origin[reads[0]]
            continue
        problem = None
        try:
            decision = rule_for(node, sequence_axis="padding")(node, placements, 1)
        except Unshardable as error:
            problem = str(error)
        else:
            if node.target is aten.scaled_dot_product_attention.default or isinstance(decision.output, PackedShard):
                problem = "attention or concatenation along the padded dim"
            elif len({origin[n] for n in reads}) > 1:
                problem = "it combines two padded values, whose real sizes may differ"
            placements[node] = decision.output
            origin[node] = origin[reads[0]]
        if problem:
            name = (what or {}).get(origin[reads[0]], f"{reads[0].name} is padded to a static bound")
            raise PartitionError(f"{name}, and {node.name} ({node.target}) would mix the padding into its result "
                                 f"({problem}); only row-wise ops and indexing along the padded dim may read it")
    return readers


def _picks_rows_along(node: Node, reads: list[Node], placements: dict) -> bool:
    """``node`` picks rows of the one padded value it reads, by index, along the padded dim."""
    if node.target not in (aten.index_select.default, aten.index.Tensor) or reads != [node.args[0]]:
        return False
    source = node.args[0]
    ndim = len(source.meta["val"].shape)
    if node.target is aten.index_select.default:
        return node.args[1] % ndim == placements[source].dim
    if node.target is aten.index.Tensor:  # x[index]: one index tensor, on the padded dim
        indices = node.args[1]
        given = [dim for dim, index in enumerate(indices) if index is not None]
        return given == [placements[source].dim] and indices[given[0]].meta["val"].dtype != torch.bool
    return False


# ---- buckets: which sizes a padded input dim is served at ----

Buckets = dict[tuple[str, int], tuple[int, ...]]  # (input name, dim) -> the sizes it is padded to, ascending


def parse_buckets(buckets: dict | None) -> Buckets:
    """``{"timestep": [2, 4]}`` (dim 0) or ``{("timestep", 0): 4}`` -> ``{("timestep", 0): (2, 4)}``."""
    parsed: Buckets = {}
    for key, sizes in (buckets or {}).items():
        name, dim = (key, 0) if isinstance(key, str) else key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes) if isinstance(sizes, Iterable) else ()
        if not isinstance(name, str) or not isinstance(dim, int) or dim < 0 or not sizes \
                or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise InputError(f"buckets={{{key!r}: {sizes!r}}}: use {{input name: size or sizes}} (dim 0) or "
                             "{(input name, dim): sizes}, dim >= 0 and sizes positive integers")
        parsed[(name, dim)] = tuple(sorted(set(sizes)))
    return parsed


def bucket_for(size: int, sizes: tuple[int, ...], name: str, dim: int, owner: str) -> int:
    """The smallest bucket that holds ``size``; an ``InputError`` naming the input when none does."""
    for bucket in sizes:
        if size <= bucket:
            return bucket
    raise InputError(f"{owner}: {name} has {size} entries along dim {dim}, more than every bucket it is served at "
                     f"({list(sizes)}); partition again with a larger bucket")


def pad_dim(value: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``value`` with zeros appended along ``dim`` up to ``size``."""
    if value.shape[dim] == size:
        return value
    shape = list(value.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([value, value.new_zeros(shape)], dim)


def pad_named(named: dict, buckets: Buckets, owner: str, *, shapes_only: bool = False) -> dict:
    """The call's arguments with every bucketed dim padded to its bucket; ``InputError`` for an unknown input, a
    dim it does not have, or a size beyond the largest bucket. With ``shapes_only`` a padded tensor is an empty
    meta tensor of the padded shape: enough to name the program a call runs on, without copying anything."""
    leaves, spec = pytree.tree_flatten_with_path(named)
    names = [argument_name(path) for path, _ in leaves]
    values = [leaf for _, leaf in leaves]
    for (name, dim), sizes in buckets.items():
        if name not in names and name in named:
            given = repr(named[name])
            raise InputError(f"{owner}: {name} must be a tensor (buckets pad it along dim {dim}), got "
                             f"{type(named[name]).__name__} {given if len(given) <= 60 else given[:57] + '...'}")
        if name not in names:
            raise InputError(f"{owner}: buckets name {name!r}, which is not a forward argument; the tensor "
                             f"arguments are {[n for n, v in zip(names, values) if isinstance(v, torch.Tensor)]}")
        position = names.index(name)
        value = values[position]
        if not isinstance(value, torch.Tensor) or dim >= value.dim():
            raise InputError(f"{owner}: buckets pad {name} along dim {dim}, which "
                             + (f"it does not have (shape {list(value.shape)})" if isinstance(value, torch.Tensor)
                                else f"is not a tensor ({type(value).__name__})"))
        bucket = bucket_for(value.shape[dim], sizes, name, dim, owner)
        if shapes_only and bucket != value.shape[dim]:
            shape = list(value.shape)
            shape[dim] = bucket
            values[position] = torch.empty(shape, dtype=value.dtype, device="meta")
        else:
            values[position] = pad_dim(value, dim, bucket)
    return pytree.tree_unflatten(values, spec)
