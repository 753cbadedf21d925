"""Collectives paired with their true backward, for the training copy of a rank program (``passes.differentiate``).

Every rank computes the same loss from the same whole outputs, so the gradient the ranks must hold for a value is
what one device would compute, laid out as the value is (DTensor's and Megatron's convention):

- a replicated value's gradient is whole and alike on every rank. A sum over ranks whose result every rank then uses
  alike (``summed``: Partial -> Replicate) passes it back unchanged, not summed again (what torch's own all_reduce
  backward does: tp gradients tp times too large); a gather (``gathered``: Shard -> Replicate) passes back this
  rank's rows of it;
- where a replicated value is read by a rank's own share of the work (its column shard of a projection, its slice
  of the rows), each rank's backward yields only its share of the gradient: ``sum_gradients`` (identity forward)
  sums those shares over the axis, so replicas, weights included, get the whole gradient and never drift;
- a sharded value's gradient is this rank's rows of it: an all_to_all is answered by the inverse all_to_all, a
  reduce_scatter by an all_gather (the exchanges and sums inside the kernels, ring and halo passes and sharded
  norms, are paired in ``runtime.kernel_gradients``).

Shapes, dims and sizes are a rank's own, as ``runtime.collectives`` takes them.
"""

from __future__ import annotations

import torch

from . import collectives
from .kernel_gradients import summed_now

functional = collectives.functional


def _gather(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    return collectives.all_gather_wait(collectives.all_gather_start(x, dim, sizes, group_name), dim, sizes)


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, scatter_sizes: list[int], gather_sizes: list[int],
              index: int, group_name: str) -> torch.Tensor:
    issued = collectives.all_to_all_start(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index, None,
                                          group_name)
    return collectives.all_to_all_wait(issued, list(x.shape), scatter_dim, gather_dim, scatter_sizes, gather_sizes,
                                       index, None)


class _Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return summed_now(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_names):
        ctx.group_names = group_names
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for group_name in ctx.group_names:
            grad = summed_now(grad, group_name)
        return grad, None


class _Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, index, group_name):
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:index]), sizes[index]
        return _gather(x, dim, sizes, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None, None


class _ReduceScattered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, index, group_name):
        ctx.dim, ctx.sizes, ctx.group_name = dim, sizes, group_name
        issued = collectives.reduce_scatter_start(x, dim, sizes, group_name)
        return collectives.reduce_scatter_wait(issued, dim, sizes[index])

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.sizes, ctx.group_name), None, None, None, None


class _Exchanged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index, group_name):
        ctx.arguments = (gather_dim, scatter_dim, gather_sizes, scatter_sizes, index, group_name)  # the inverse
        return _exchange(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index, group_name)

    @staticmethod
    def backward(ctx, grad):
        return (_exchange(grad.contiguous(), *ctx.arguments),) + (None,) * 6


def summed(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Partial -> Replicate: the sum over the axis, whose gradient every rank holds whole (passed back as it is)."""
    return _Summed.apply(x, group_name)


def sum_gradients(x: torch.Tensor, group_names: list[str]) -> torch.Tensor:
    """``x`` itself, whose gradient is summed over each of ``group_names`` on the way back: a replicated value read
    by each rank's own share of the work."""
    return _SumGradients.apply(x, group_names)


def gathered(x: torch.Tensor, dim: int, sizes: list[int], index: int, group_name: str) -> torch.Tensor:
    """Shard -> Replicate along ``dim`` (rank i holds ``sizes[i]`` rows, this one ``index``): this rank's rows of
    the whole gradient back."""
    return _Gathered.apply(x, dim, sizes, index, group_name)


def reduce_scattered(x: torch.Tensor, dim: int, sizes: list[int], index: int, group_name: str) -> torch.Tensor:
    """Partial -> Shard along ``dim``: the gradient of every rank's rows gathered back."""
    return _ReduceScattered.apply(x, dim, sizes, index, group_name)


def exchanged(x: torch.Tensor, scatter_dim: int, gather_dim: int, scatter_sizes: list[int], gather_sizes: list[int],
              index: int, group_name: str) -> torch.Tensor:
    """Shard(gather_dim) -> Shard(scatter_dim) (Ulysses): the gradient goes back by the inverse all_to_all."""
    return _Exchanged.apply(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index, group_name)
