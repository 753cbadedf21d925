"""The rewrite passes, in the order they run. Each is ``run(gm, ctx) -> gm`` and checks its own postcondition."""

from . import annotate_heads, hoist_host, insert_collectives, localize, plan_sequence, plan_sharding

PIPELINE = (
    ("hoist_host", hoist_host.run),
    ("annotate_heads", annotate_heads.run),
    ("plan_sharding", plan_sharding.run),
    ("plan_sequence", plan_sequence.run),
    ("insert_collectives", insert_collectives.run),
    ("localize", localize.run),
)
