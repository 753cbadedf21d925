"""Collectives already in a traced graph (a model that communicates itself, e.g. one written with DTensor or
functional collectives). Partitioning it again would run its collectives on groups the plan knows nothing about,
inside a program whose values the plan has already cut: refused, whatever the placements."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers torch.ops._c10d_functional)
from torch.fx import Node

from ..errors import PartitionError
from .core import Decision, register

functional = torch.ops._c10d_functional
COLLECTIVES = tuple(getattr(functional, name).default for name in
                    ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                     "broadcast", "wait_tensor") if hasattr(functional, name))


@register(*COLLECTIVES)
def already_communicates(node: Node, placements, axis_size: int) -> Decision:
    raise PartitionError(f"{node.name}: the traced graph already runs the collective {node.target}; partition the "
                         "model without its own communication (one device's forward)")
