"""One annotation per node: what the passes record about a value, under ``node.meta[KEY]``.

Each field names the pass that decides it (passes that rewrite nodes later, such as chunk_reductions or the
training copy, give the nodes they make the same fields). A node without an annotation reads as an empty one
(every field None). A pass that copies a node's meta takes a copy of its annotation (``copied_meta``), so that the
two nodes' fields can be reassigned apart (the planned graph and the rank program); the dicts inside (placements,
requirements, placed-by) stay shared, as the passes after planning reassign rather than mutate them (placed-by
only gains axes it has not recorded). Copies made for reading only (the preflight program, the host prologue,
Inductor's split) share the annotation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.fx import Node

KEY = "partitioner"


@dataclass
class Annotation:
    # plan_sharding, plan_sequence, plan_batch (and insert_collectives / collective_kernels for the nodes they add):
    placements: dict | None = None  # mesh axis -> placement (a tuple for a multi-output op)
    required: dict | None = None  # mesh axis -> {input node: the placement that input must have here}
    # annotate_heads: the attention a q/k/v split, head merge, projection or attention belongs to (a HeadInfo)
    heads: object = None
    # insert_collectives, collective_kernels: (CollectiveKind, mesh axis) of a node that communicates
    collective: tuple | None = None
    in_flight: bool | None = None  # insert_collectives: an issued collective's buffer, shaped as it travels
    local_slice: bool | None = None  # insert_collectives: a slice whose bounds are this rank's already
    rank_order: tuple | None = None  # insert_collectives: (axis, blocks) of an exchange delivering rows in rank order
    global_shape: tuple | None = None  # localize: the value's shape before it was cut to this rank's part
    placed_by: dict | None = None  # the pass runner: mesh axis -> the pass that placed the value
    row_owners: bool | None = None  # gather_scatters: the rows each rank builds of a sequence (its owners)
    narrowed_from: object = None  # narrow_indices: the dtype an index input was narrowed from
    nonnegative: str | None = None  # narrow_indices: the node that proves an index input non-negative


def annotation(node: Node) -> Annotation:
    """``node``'s annotation, made empty on first use."""
    found = node.meta.get(KEY)
    if found is None:
        found = node.meta[KEY] = Annotation()
    return found


def copied_meta(node: Node) -> dict:
    """A copy of ``node``'s meta whose annotation is a copy too."""
    meta = dict(node.meta)
    if KEY in meta:
        meta[KEY] = replace(meta[KEY])
    return meta
