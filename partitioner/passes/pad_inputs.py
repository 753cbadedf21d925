"""pad_inputs: prove that the input dims the caller pads to buckets are never read into a result.

``partition(..., buckets={"timestep": [2, 4]})`` traces the model on inputs padded with zeros to their bucket, so one
partition serves every size up to it (a diffusion step's timestep table has 1 to 4 rows). That is exact only if no
result depends on the padding rows.

Requires: the device graph (``hoist_host``: a padded input must not feed data-dependent host code, which would see
its padding).
Guarantees: each padded dim only flows through row-wise ops and ends where rows are picked by an index along it
(``padding.follow_padding``); every such index is computed from the call's inputs alone, so ``Preflight`` checks it
against the call's real rows before the device graph runs (``ctx.padding_reads``). Otherwise a ``PartitionError``
names the input, dim and op.
"""

from __future__ import annotations

from torch.fx import GraphModule

from ..errors import InvariantError, PartitionError
from ..frontend.padding import follow_padding
from ..runtime.preflight import computable_from_call, index_operands
from .context import PassContext


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if not ctx.buckets:
        return gm
    by_name = {ctx.input_names[gi.target]: (node, gi.target) for node, gi in ctx.placeholder_inputs(gm).items()
               if gi.kind == "user"}
    host_read = set(ctx.host.inputs) if ctx.host is not None else set()
    padded, what, argument = {}, {}, {}
    for (name, dim), sizes in ctx.buckets.items():
        if name not in by_name:
            continue  # the graph never reads it (or export made it a constant): padding changes nothing
        node, index = by_name[name]
        if index in host_read:
            raise PartitionError(f"buckets pad {name} along dim {dim}, but data-dependent host code reads {name} "
                                 f"({', '.join(ctx.host.hoisted)}) and would see the padding; do not bucket it")
        padded[node], argument[node] = dim, index
        what[node] = f"{name} is padded along dim {dim} to its bucket ({list(sizes)})"
    readers = follow_padding(gm, padded, what=what)
    computable = computable_from_call(gm, ctx.inputs, ctx.input_names)
    ctx.padding_reads = {}
    for reader, source in readers.items():
        index = index_operands(reader)[0][0]
        if not computable.get(index):
            raise PartitionError(f"{what[source]}, and {reader.name} picks its rows by an index that is not "
                                 "computed from the call's inputs alone, so no check can keep it off the padding")
        ctx.padding_reads[reader.name] = (argument[source], padded[source], source.meta["val"].shape[padded[source]])
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every recorded padded read is a node of the graph."""
    names = {node.name for node in gm.graph.nodes}
    missing = [name for name in ctx.padding_reads if name not in names]
    if missing:
        raise InvariantError(f"padded reads {missing} are not in the graph")
