"""The exchanges and sums inside the collective kernels (``runtime.collectives``: ring attention's key/value steps,
a halo's borrowed rows, a sharded norm's statistics) paired with their true backward, taken when autograd records
through a kernel (``recording``); ``runtime.differentiable`` pairs the graph's own collectives."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers torch.ops._c10d_functional)

functional = torch.ops._c10d_functional


def summed_now(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, waited for (no autograd: the backwards' own sum)."""
    return functional.wait_tensor(functional.all_reduce(x.contiguous(), "sum", group_name))


class _SumBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return summed_now(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return summed_now(grad, ctx.group_name), None


class _Permuted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes_in, sizes_out, group_name):
        ctx.arguments = (sizes_out, sizes_in, group_name)  # what came back the way it went
        return functional.wait_tensor(functional.all_to_all_single(x.contiguous(), sizes_in, sizes_out, group_name))

    @staticmethod
    def backward(ctx, grad):
        sizes_in, sizes_out, group_name = ctx.arguments
        returned = functional.all_to_all_single(grad.contiguous(), sizes_in, sizes_out, group_name)
        return functional.wait_tensor(returned), None, None, None


def sum_over_ranks(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """A statistic summed over the ranks inside a sharded kernel (a norm's sum of squares), whose every reader is a
    rank's own shard: the shares of its gradient are summed on the way back too."""
    return _SumBothWays.apply(x, group_name)


def permuted(x: torch.Tensor, sizes_in: list[int], sizes_out: list[int], group_name: str) -> torch.Tensor:
    """A point-to-point exchange as one all_to_all_single (a ring step, a halo): the gradient returns the way the
    data came."""
    return _Permuted.apply(x, sizes_in, sizes_out, group_name)


def recording(*tensors) -> bool:
    """Whether autograd records a graph through these tensors (the kernels then take their differentiable path)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
