"""The eager backend: run the per-rank GraphModule as it is, op by op (collectives on the mesh's process groups)."""

from __future__ import annotations

import torch

from .base import Backend, register


def lower(gm: torch.fx.GraphModule, *, mesh=None, collectives=None) -> torch.fx.GraphModule:
    del mesh, collectives  # the graph's collectives already name the mesh's process groups
    return gm


def train(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return gm  # run op by op with autograd recording


register(Backend("eager", "rank", lower, train=train))
