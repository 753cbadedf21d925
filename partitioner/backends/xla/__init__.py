"""XLA SPMD (torch_xla): the plan's placements become sharding annotations; XLA's SPMD partitioner inserts the
collectives, and its partitioned HLO is checked against the plan.

One process drives every XLA device, so this backend takes the *global* planned graph (``Partitioned.planned_graph``,
before ``insert_collectives``) and the model's full tensors. It interprets the graph on XLA tensors and annotates:

- every input with ``mark_sharding`` from its placements (``Shard(d)`` over an axis puts that mesh axis on dim
  ``d``; a dim sharded over several axes lists them in mesh order, as ``localize`` splits them);
- every value whose placements XLA can express (no ``Partial``) with a custom sharding annotation, so XLA's
  propagation has no freedom to pick another layout;
- every edge where a consumer requires another placement than its producer has (the edges where
  ``insert_collectives`` puts a collective) with a second annotation on a copy: Shard(a) -> Shard(b) becomes XLA's
  all-to-all, Partial -> Replicate its all-reduce, Shard -> Replicate its all-gather, Replicate -> Shard a local
  slice.

Two layouts differ from the plan's global one, where XLA's equal tiles cannot express what a rank holds:

- packed values (a ``PackedShard``: SwiGLU's ``[value; gate]`` in one Linear, Flux's ``cat([attention, mlp])``
  before a row-wise Linear): each rank holds a slice of every block, not one contiguous range. Annotated naively,
  XLA re-lays the blocks out with collective-permutes. They are held rank-major instead (``Packed``);
- a dim split over tp and then unevenly over ulysses (3 heads per tp rank, 2 + 1): each tp shard is padded to a
  multiple of the ulysses degree around the exchange (``Nested``).

Heads split unevenly over tp (6 heads over 4 ranks: 2, 2, 1, 1) are annotated as plain shards: XLA pads them to
equal tiles and moves data at the head reshapes, which is exact but is not the plan's communication, so
``verify=True`` refuses such a plan by name (``verify="warn"`` runs it).

Three ops are written out so that XLA keeps their operands sharded: Linear and attention as einsums
(``aten.linear`` and ``scaled_dot_product_attention`` flatten batch dims into one, merging a sharded dim with an
unsharded one), and layer_norm as reductions over its dims (torch_xla lowers it to batch-norm over the rows). An
attention whose keys a ring axis shards is written out as ring attention over equal sequence blocks, its key/value
blocks passed on by collective-permutes (``ops._ring_attention``).

The package: ``layouts`` (partition specs, ``Packed``, ``Nested``), ``ops`` (the written-out ops, ops on packed
values), ``annotate`` (running the graph with its annotations), ``hlo`` (reading the partitioned HLO), ``program``
(XLA's runtime, inputs on the devices, the check against the plan), ``errors``. torch_xla is imported only when a
program is built.
"""

from __future__ import annotations

from collections import Counter

from torch.fx import GraphModule

from ..base import Backend, register
# What callers and tests import from ``partitioner.backends.xla`` (``_linear`` and ``_split_packed``: the packed-layout
# tests).
from .errors import CollectiveMismatch, XlaBackendError  # noqa: F401
from .hlo import HloCollective, axis_of, compare, hlo_collectives, plan_key, ring_of  # noqa: F401
from .layouts import Nested, Packed, nested_uneven, packed_spec, partition_spec, uneven_splits  # noqa: F401
from .ops import _linear, _split_packed  # noqa: F401
from .program import XlaProgram, XlaStats  # noqa: F401


def lower(planned: GraphModule, *, mesh, collectives: Counter | None = None, verify: bool | str = True):
    """``planned``: the global graph with placements. ``verify``: True checks the first call's partitioned HLO
    against ``collectives`` (the plan's (kind, axis) -> count) and raises ``CollectiveMismatch``; "warn" warns;
    False skips reading the HLO."""
    if verify and collectives is None:
        raise XlaBackendError("verify needs the plan's collectives")
    uneven = uneven_splits(planned, mesh)
    if uneven and verify is True:
        raise XlaBackendError(
            f"the plan splits {len(uneven)} values unevenly in whole units (heads or fused blocks that the tp degree "
            f"does not divide, e.g. {uneven[0]}); XLA tiles every dim in equal padded pieces, so its partitioner adds "
            "all-gathers and collective-permutes around them that the plan does not have. The results are exact: "
            "compile with verify='warn' (or False) to run it anyway, or use a tp degree that divides the head count")
    return XlaProgram(planned, mesh, collectives or Counter(), verify)


register(Backend("xla", "global", lower, options=("verify",)))
