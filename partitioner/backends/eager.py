"""The eager backend: run the per-rank GraphModule as it is, op by op (collectives on the mesh's process groups)."""

from __future__ import annotations

import torch

from ..runtime.agreement import settling_first
from .base import Backend, register


def lower(gm: torch.fx.GraphModule, *, mesh=None, collectives=None) -> torch.fx.GraphModule:
    """``gm`` itself, but for the call's agreement settled just before its first collective (the compute ahead of
    it overlaps the agreement's all_reduce)."""
    del mesh, collectives  # the graph's collectives already name the mesh's process groups
    return settling_first(gm)


def train(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return gm  # run op by op with autograd recording


register(Backend("eager", "rank", lower, train=train))
