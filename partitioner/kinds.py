"""The kinds the graph's annotations name (and ``decisions.Style``), as enums (one place; no dependencies). Each is a ``StrEnum`` whose
``repr`` is its value's: dumps, messages and counts keyed by kind read as they did when kinds were strings, and a
kind still compares equal to its name (``counts[("all_reduce", "tp")]``)."""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    def __repr__(self) -> str:
        return repr(self.value)


class InputKind(Kind):
    """What a graph placeholder is (``frontend.trace.GraphInput``)."""
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"  # a tensor the model makes from literals, or that the trace folded
    USER = "user"  # one of the forward's flattened arguments
    HOST = "host"  # a value the host prologue computes (``passes.hoist_host``)


class HeadRole(Kind):
    """Where a node stands around an attention (``passes.annotate_heads``)."""
    Q = "q"
    K = "k"
    V = "v"
    ATTENTION = "attention"
    MERGE = "merge"  # the reshape that joins heads back into features
    OUT = "out"  # the output projection


class CollectiveKind(Kind):
    """What a communicating node does (``annotation.collective = (kind, axis)``; ``insert_collectives``,
    ``collective_kernels``)."""
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    RING_PASS = "ring_pass"  # ring attention's key/value blocks sent round the ring
    HALO_EXCHANGE = "halo_exchange"  # a split convolution's border rows
