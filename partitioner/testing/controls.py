"""Negative controls: collectives replaced by what a rank computes without them, for tests that must then fail."""

from __future__ import annotations

import torch

__all__ = ["no_exchange"]


def no_exchange(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index, order, group_name,
                exchange_dtype=None):
    """In place of ``collectives.all_to_all_start``: the pieces an all_to_all receives, built from this rank's own
    rows only (shaped as the real ones, so the program runs on): what a missing exchange computes."""
    order = order or list(range(x.dim()))
    x, scatter_dim, gather_dim = x.permute(order), order.index(scatter_dim), order.index(gather_dim)
    own = x.split(scatter_sizes, dim=scatter_dim)[index]
    rows = torch.arange(sum(gather_sizes)) % own.shape[gather_dim]
    pieces = own.index_select(gather_dim, rows).split(gather_sizes, dim=gather_dim)
    return torch.cat([piece.reshape(-1) for piece in pieces])
