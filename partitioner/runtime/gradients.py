"""Calls made with gradients on. Until every collective is paired with its true backward, ``backward`` through a
rank program would be silently wrong: torch's functional all_reduce sums the gradient again on every rank (tp
gradients come out tp times too large), and a rank's slice of a replicated value never gathers its gradient back
(rows it does not hold get zero). So the program runs without recording a graph and its outputs refuse
``backward`` by name (``BackwardUnsupported``): never a silent wrong gradient, and never torch's own "does not
require grad" for a model whose weights were trainable."""

from __future__ import annotations

import torch

from ..errors import BackwardUnsupported


def wants_gradients(inputs: list, trainable: bool) -> bool:
    """Whether a call would build an autograd graph on an unpartitioned model: grad mode on, and an input that
    requires grad or weights marked to train (``trainable``: LoRA adapters on a frozen base, a model in training
    mode)."""
    return torch.is_grad_enabled() and (trainable or any(
        isinstance(value, torch.Tensor) and value.requires_grad for value in inputs))


def refusing_backward(outputs: list, inputs: list, reason: str) -> list:
    """``outputs`` (computed without autograd) as tensors whose ``backward`` raises ``BackwardUnsupported(reason)``,
    reached from every input that requires grad (or, where none does, from a trainable weight's stand-in)."""
    anchors = [value for value in inputs if isinstance(value, torch.Tensor) and value.requires_grad]
    if not anchors:
        anchors = [torch.zeros((), requires_grad=True)]  # the model's trainable weights, which the rank detached
    positions = [i for i, value in enumerate(outputs) if isinstance(value, torch.Tensor) and value.is_floating_point()]
    refused = _RefuseBackward.apply(reason, len(anchors), *anchors, *[outputs[i] for i in positions])
    result = list(outputs)
    for position, tensor in zip(positions, refused):
        result[position] = tensor
    return result


class _RefuseBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reason: str, anchors: int, *tensors):
        ctx.reason = reason
        return tuple(tensor.detach() for tensor in tensors[anchors:])  # (not views: callers may edit them in place)

    @staticmethod
    def backward(ctx, *grads):
        raise BackwardUnsupported(ctx.reason)


def backward_reason(owner: str, program: torch.fx.GraphModule, describe_collective) -> str:
    """Why ``backward`` through ``program`` is refused, naming its first collective."""
    from .collectives import STARTS

    first = next((node for node in program.graph.nodes if "collective" in node.meta or node.target in STARTS), None)
    where = describe_collective(first) if first is not None else "this rank's program, whose weights are detached"
    stack = list((first.meta.get("nn_module_stack") or {}).values()) if first is not None else []
    if stack:
        where += f" (in {stack[-1][0]})"
    return (f"{owner}: backward through a partitioned program is not supported yet: {where} has no exact backward "
            "here (a collective's backward must not sum again, a rank's slice must gather its gradient); the forward "
            "ran exact. Call the model under torch.no_grad() (inference), or train the unpartitioned model")
