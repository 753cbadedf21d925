"""The rewrite passes, in the order they run, and the runner that runs them.

Each pass is a plain function ``run(gm, ctx) -> gm`` over a ``torch.fx.GraphModule`` and the shared
``PassContext``, declared here with what it requires (passes that must have run before it), what it guarantees, and
the check of that guarantee. ``run_passes`` does the rest for every pass alike: order, lint and recompile, the
postcondition check, which pass placed each value (``annotation.placed_by``), timing, logging and dumps.

``PLAN`` leaves the global graph with a placement on every value and a requirement on every input: that is the
whole decision, and what the XLA backend hands to XLA's SPMD partitioner. ``TO_RANK`` turns it into one rank's
program (explicit collectives, local shapes) and schedules its communication to overlap its computation, for the
eager, Inductor and Neuron backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import (annotate_heads, chunk_reductions, collective_kernels, fold_conv_padding, gather_scatters, hoist_host,
               insert_collectives, localize, matmul_as_linear, pad_inputs, plan_batch, plan_sequence, plan_sharding,
               plan_tp_sequence, pointwise_convs, schedule_collectives)
from .runner import run_passes


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable  # (gm, ctx) -> gm
    check: Callable  # (gm, ctx) -> None, raises InvariantError: the guarantee, checked after every run
    requires: tuple[str, ...]  # passes that must have run before
    guarantees: str


PLAN = (
    Pass("hoist_host", hoist_host.run, hoist_host.check, (),
         "no value of the device graph has a data-dependent size; data-dependent ops run in a CPU prologue"),
    Pass("pad_inputs", pad_inputs.run, pad_inputs.check, ("hoist_host",),
         "input dims padded to a bucket are read only row by row and by indices checked against the real rows"),
    Pass("gather_scatters", gather_scatters.run, gather_scatters.check, ("pad_inputs",),
         "on a sequence-parallel mesh, a sequence built by index_copy is a gather of rows each rank can build alone"),
    Pass("fold_conv_padding", fold_conv_padding.run, fold_conv_padding.check, (),
         "a zero pad equal on both sides of a convolution's spatial dim is the convolution's own padding"),
    Pass("pointwise_convs", pointwise_convs.run, pointwise_convs.check, (),
         "every 1x1 convolution (stride 1, no padding, one group) is a linear over the channel dim"),
    Pass("matmul_as_linear", matmul_as_linear.run, matmul_as_linear.check, (),
         "every matrix product of a value by a weight (a quantised Linear's) is a linear"),
    Pass("annotate_heads", annotate_heads.run, annotate_heads.check, (),
         "attentions and their projections carry their heads; head splits infer the head count from head_dim"),
    Pass("plan_sharding", plan_sharding.run, plan_sharding.check,
         ("pointwise_convs", "matmul_as_linear", "annotate_heads"),
         "every value has a 'tp' placement and every input a 'tp' requirement"),
    Pass("plan_sequence", plan_sequence.run, plan_sequence.check, ("plan_sharding",),
         "every value has a 'ulysses' placement and every input a 'ulysses' requirement"),
    Pass("plan_batch", plan_batch.run, plan_batch.check, ("plan_sequence",),
         "on a dp/cfg axis every value has a batch placement: inputs split along the batch, outputs gathered"),
    Pass("plan_tp_sequence", plan_tp_sequence.run, plan_tp_sequence.check, ("plan_batch",),
         "where it pays, the values between the tp regions are sharded along their rows over tp (reduce-scattered "
         "in, all-gathered out) instead of repeated on every tp rank"),
)
TO_RANK = (
    Pass("insert_collectives", insert_collectives.run, insert_collectives.check,
         ("plan_sharding", "plan_sequence", "plan_tp_sequence"),
         "every input of every node is placed as the node requires"),
    Pass("collective_kernels", collective_kernels.run, collective_kernels.check, ("insert_collectives",),
         "attentions over ring-sharded keys are ring_attention, convolutions over split rows halo_convolution, "
         "masks read in the order a packed exchange delivers rows"),
    Pass("localize", localize.run, localize.check, ("collective_kernels",),
         "every value has this rank's shape; every sharded tensor has a slicing spec"),
    Pass("chunk_reductions", chunk_reductions.run, chunk_reductions.check, ("localize",),
         "a row-parallel linear whose all_reduce pays to hide runs in row chunks, each chunk's sum in flight "
         "while the next chunk is computed"),
    Pass("schedule_collectives", schedule_collectives.run, schedule_collectives.check, ("localize",),
         "collectives issued as early as their inputs allow, waited on after the independent compute that covers "
         "them; issue order unchanged"),
)
PIPELINE = PLAN + TO_RANK

__all__ = ["PIPELINE", "PLAN", "Pass", "TO_RANK", "run_passes"]
