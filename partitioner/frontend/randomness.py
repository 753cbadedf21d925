"""Random numbers drawn inside the traced graph (dropout in training mode, noise the model adds): each rank would
draw its own, so ranks holding the same rows would compute different values and a sharded value would be cut from
different draws, silently. Refused by name until the ranks draw from one agreed seed per call."""

from __future__ import annotations

import torch

from ..errors import PartitionError
from .trace import source_line

aten = torch.ops.aten
RANDOM_OPS = {aten.dropout, aten.native_dropout, aten.feature_dropout, aten.alpha_dropout, aten.feature_alpha_dropout,
              aten.bernoulli, aten.bernoulli_, aten.rand, aten.randn, aten.randint, aten.rand_like, aten.randn_like,
              aten.randint_like, aten.normal, aten.normal_, aten.uniform, aten.uniform_, aten.multinomial,
              aten.randperm, aten.exponential, aten.exponential_, aten.poisson, aten.rrelu_with_noise}


def refuse_randomness(gm: torch.fx.GraphModule, model_name: str) -> None:
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or packet not in RANDOM_OPS:
            continue
        if packet in (aten.dropout, aten.feature_dropout, aten.alpha_dropout, aten.feature_alpha_dropout) and \
                not (len(node.args) > 2 and node.args[2] and node.args[1]):
            continue  # dropout with p=0 or train=False draws nothing
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        where = stack[-1][0] if stack else "the model"
        raise PartitionError(f"{model_name} draws random numbers in its forward ({packet.__name__} in {where}, "
                             f"{source_line(node)}): each rank would draw its own, so ranks would compute different "
                             "values; call model.eval() before partition (dropout draws nothing in eval mode), or "
                             "run the randomness outside the model and pass its result in")
