"""Random numbers drawn inside the traced graph (dropout in training mode, noise the model adds): each rank would
draw its own, so ranks holding the same rows would compute different values and a sharded value would be cut from
different draws, silently. Refused by name until the ranks draw from one agreed seed per call."""

from __future__ import annotations

import torch

from ..errors import PartitionError
from ..source import source_line


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: an op torch tags ``nondeterministic_seeded`` (dropout, bernoulli,
    rand*, normal, cauchy, rrelu, an attention with dropout, ...), unless its arguments say it draws nothing (a
    probability of 0, training off)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    given = {argument.name: argument.default_value for argument in schema.arguments if argument.has_default_value()}
    given.update({argument.name: value for argument, value in zip(schema.arguments, node.args)})
    given.update(node.kwargs)
    if given.get("train", given.get("training", True)) is False:
        return False
    probability = given.get("p", given.get("dropout_p"))
    return not (isinstance(probability, (int, float)) and probability == 0)


def refuse_randomness(gm: torch.fx.GraphModule, model_name: str) -> None:
    for node in gm.graph.nodes:
        if not _draws(node):
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        where = (stack[-1][0] if stack else "") or "its forward"
        raise PartitionError(f"{model_name} draws random numbers in its forward "
                             f"({node.target.overloadpacket.__name__} in {where}, {source_line(node)}): each rank "
                             "would draw its own, so ranks would compute different values; call model.eval() before "
                             "partition (dropout draws nothing in eval mode), or run the randomness outside the model "
                             "and pass its result in")
