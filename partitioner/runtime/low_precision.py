"""Exchanges in a lower precision (``partition(..., exchange_dtype=)``, opt-in): an all_to_all's pieces cast to
float8 with one float32 scale per row, or to bfloat16, before they are sent, and restored to the value's dtype when
they arrive. Sums (all_reduce, reduce_scatter) never travel so: their error would grow with the rank count.

A row is a run along the value's longest dim that the exchange neither splits nor joins (a head's ``head_dim`` for
Ulysses' query, key, value and output); a value with no such dim, or rows too short to pay for their scales,
travels in its own dtype. A row's scale is its largest magnitude over the float8 dtype's largest finite
value, so every element is represented with the dtype's relative precision (e4m3: 2^-4) and none saturates. A piece
travels as its encoded bytes followed by its scales' bytes, one uint8 buffer per exchange: the collective's size
in the report is what is sent, scales included.
"""

from __future__ import annotations

import math

import torch

SCALED = (torch.float8_e4m3fn, torch.float8_e5m2)  # cast with per-row scales
CAST = (torch.bfloat16,)  # cast as it is (float32's range)
DTYPES = SCALED + CAST
_SCALE = torch.float32
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row keeps a finite scale


def applies(dtype: torch.dtype | None, exchange_dtype: torch.dtype | None) -> bool:
    """Whether a value of ``dtype`` travels in ``exchange_dtype``: only a wider floating one."""
    return (exchange_dtype is not None and dtype is not None and dtype.is_floating_point
            and torch.finfo(dtype).bits > torch.finfo(exchange_dtype).bits)


def row_dim(shape, scatter_dim: int, gather_dim: int) -> int | None:
    """The dim a scale covers: the longest one the exchange neither splits nor joins (the last of equals: a head's
    ``head_dim`` for Ulysses' [batch, heads, rows, head_dim]); None where there is none."""
    free = [dim for dim in range(len(shape)) if dim not in (scatter_dim, gather_dim)]
    return max(reversed(free), key=lambda dim: shape[dim]) if free else None


def pays(shape, dtype: torch.dtype, exchange_dtype: torch.dtype | None, scatter_dim: int, gather_dim: int) -> bool:
    """Whether a value of ``shape`` and ``dtype`` travels in ``exchange_dtype``: a wider floating value, in fewer
    bytes than its own (a float8 row needs a dim of its own for its scale, and enough elements to pay for it)."""
    if not applies(dtype, exchange_dtype):
        return False
    rows = row_dim(shape, scatter_dim, gather_dim)
    if rows is None and exchange_dtype in SCALED:
        return False
    return encoded_bytes(shape, exchange_dtype, rows) < math.prod(shape) * dtype.itemsize


def _scale_shape(shape, rows: int | None) -> list[int]:
    return [1 if rows is None or dim == rows else size for dim, size in enumerate(shape)]


def encoded_bytes(shape, exchange_dtype: torch.dtype, rows: int | None) -> int:
    """Bytes a piece of ``shape`` travels as: its elements in ``exchange_dtype``, then its scales."""
    size = math.prod(shape) * exchange_dtype.itemsize
    if exchange_dtype in SCALED:
        size += math.prod(_scale_shape(shape, rows)) * _SCALE.itemsize
    return size


def encode(piece: torch.Tensor, exchange_dtype: torch.dtype, rows: int | None) -> torch.Tensor:
    """``piece`` as the flat uint8 bytes it travels as."""
    if exchange_dtype not in SCALED:
        return piece.to(exchange_dtype).contiguous().view(torch.uint8).reshape(-1)
    wide = piece.to(_SCALE)
    dims = [rows] if rows is not None else list(range(piece.dim()))
    largest = wide.abs().amax(dim=dims, keepdim=True) if piece.numel() else wide.new_ones(_scale_shape(piece.shape,
                                                                                                       rows))
    scale = (largest / torch.finfo(exchange_dtype).max).clamp(min=_TINY)
    encoded = (wide / scale).to(exchange_dtype)
    return torch.cat([encoded.contiguous().view(torch.uint8).reshape(-1),
                      scale.contiguous().view(torch.uint8).reshape(-1)])


def decode(data: torch.Tensor, shape, exchange_dtype: torch.dtype, dtype: torch.dtype,
           rows: int | None) -> torch.Tensor:
    """The piece of ``shape`` in ``dtype`` from the bytes ``encode`` made."""
    count = math.prod(shape) * exchange_dtype.itemsize
    values = data[:count]
    if values.storage_offset() % exchange_dtype.itemsize:  # a piece's bytes start anywhere in the received buffer
        values = values.clone()
    values = values.view(exchange_dtype).view(list(shape))
    if exchange_dtype not in SCALED:
        return values.to(dtype)
    scale = data[count:].clone().view(_SCALE).view(_scale_shape(shape, rows))  # (a copy: aligned for the view)
    return (values.to(_SCALE) * scale).to(dtype)


def check_exchange_dtype(exchange_dtype, model: torch.nn.Module) -> None:
    """``partition(..., exchange_dtype=)``: one of ``DTYPES``, for a model run for inference."""
    from ..errors import InputError

    if exchange_dtype is None:
        return
    if exchange_dtype not in DTYPES:
        raise InputError(f"exchange_dtype={exchange_dtype!r}: use one of {[str(d) for d in DTYPES]} (float8 travels "
                         "with a float32 scale per row), or None for exchanges in the values' own dtype")
    if model.training and any(p.requires_grad for p in model.parameters()):
        raise InputError(f"exchange_dtype={exchange_dtype}: a low-precision exchange is for inference (its rounding "
                         f"has no gradient), and {type(model).__name__} is in training mode; call model.eval() or "
                         "drop exchange_dtype")
