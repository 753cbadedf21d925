"""Calls made with gradients on. Until every collective is paired with its true backward, ``backward`` through a
rank program would be silently wrong: torch's functional all_reduce sums the gradient again on every rank (tp
gradients come out tp times too large), and a rank's slice of a replicated value never gathers its gradient back
(rows it does not hold get zero). So the program runs without recording a graph and its outputs refuse
``backward`` by name (``BackwardUnsupported``): never a silent wrong gradient, and never torch's own "does not
require grad" for a model whose weights were trainable."""

from __future__ import annotations

import torch

from ..errors import BackwardUnsupported


def marked_to_train(requires_grad: list[bool], training: bool) -> bool:
    """Whether the user marked weights to train: some frozen and others not (LoRA adapters on a frozen base), or a
    model in training mode. (Every weight requires grad by default, also in inference: that marks nothing.)"""
    return any(requires_grad) and (training or not all(requires_grad))


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


def backward_reason(owner: str, program: torch.fx.GraphModule) -> str:
    """Why ``backward`` through ``program`` is refused, naming its first collective and the module that made it."""
    from ..passes.annotate_heads import module_path
    from .agreement import describe_collective
    from .collectives import STARTS

    first = next((node for node in program.graph.nodes if "collective" in node.meta or node.target in STARTS), None)
    where = describe_collective(first) if first is not None else "this rank's program, whose weights are detached"
    if first is not None and module_path(first):
        where += f" (in {module_path(first)})"
    return (f"{owner}: backward through a partitioned program is not supported yet: {where} has no exact backward "
            "here (a collective's backward must not sum again, a rank's slice must gather its gradient); the forward "
            "ran exact. Call the model under torch.no_grad() (inference), or train the unpartitioned model")
