"""The rewrite passes, in the order they run. Each is ``run(gm, ctx) -> gm`` and checks its own postcondition.

``PLAN`` leaves the global graph with a placement on every value and a requirement on every input: that is the
whole decision, and what the XLA backend hands to XLA's SPMD partitioner. ``TO_RANK`` turns it into one rank's
program (explicit collectives, local shapes), for the eager, Inductor and Neuron backends.
"""

from . import annotate_heads, hoist_host, insert_collectives, localize, plan_sequence, plan_sharding

PLAN = (
    ("hoist_host", hoist_host.run),
    ("annotate_heads", annotate_heads.run),
    ("plan_sharding", plan_sharding.run),
    ("plan_sequence", plan_sequence.run),
)
TO_RANK = (
    ("insert_collectives", insert_collectives.run),
    ("localize", localize.run),
)
PIPELINE = PLAN + TO_RANK
