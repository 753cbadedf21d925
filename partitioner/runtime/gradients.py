"""Calls made with gradients on. Where ``backward`` through a rank program cannot be exact (a backend that runs
inference only, the torch.compile frontend, an op ``passes.differentiate`` cannot pair), the program runs without
recording a graph and its outputs refuse ``backward`` by name (``BackwardUnsupported``): never a silent wrong
gradient (torch's own collectives' backward sums again on every rank, and a rank's slice never gathers its
gradient back), and never torch's own "does not require grad" for a model whose weights were trainable."""

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


def frontend_reason(owner: str) -> str:
    """Why ``backward`` through the torch.compile frontend is refused: dynamo hands it the model's whole parameters
    as inputs, which no rank program trains."""
    return (f"{owner}: backward through the torch.compile frontend is not supported (it runs inference only); to "
            "train, partition(model, mesh, example_inputs).compile('eager' or 'inductor') exposes this rank's "
            "trainable weights as parameters, or call the model under torch.no_grad()")
