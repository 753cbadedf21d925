"""Collectives the rewritten graphs call, over PyTorch's functional collectives (each followed by wait_tensor).

They take plain ints and a process group name, so a rank's graph stays a pure function of its inputs, and they
handle uneven shards: a sequence of 23 rows over 2 ranks is 12 + 11, 7 heads over 4 ranks 2 + 2 + 2 + 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers torch.ops._c10d_functional)

from . import kernel_gradients, low_precision

functional = torch.ops._c10d_functional


def all_gather_start(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    """Issue the concatenation of every rank's shard of ``x`` along ``dim`` (rank i holds ``sizes[i]`` rows of
    it): the gathered buffer, in flight until ``all_gather_wait`` (every rank's rows at the front, each piece padded
    to the largest: all_gather_into_tensor needs equal pieces)."""
    largest = max(sizes)
    front = x.movedim(dim, 0)
    if front.shape[0] < largest:
        front = torch.cat([front, front.new_zeros((largest - front.shape[0], *front.shape[1:]))])
    return functional.all_gather_into_tensor(front.contiguous(), len(sizes), group_name)


def all_gather_wait(issued: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """Wait for an issued ``all_gather`` and drop the padding."""
    gathered = functional.wait_tensor(issued)
    if len(set(sizes)) > 1:
        gathered = torch.cat([piece[:size] for piece, size in zip(gathered.split(max(sizes)), sizes)])
    return gathered.movedim(0, dim)


def reduce_scatter_start(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    """Issue the sum of ``x`` over the ranks, each keeping its rows of ``dim`` (rank i gets ``sizes[i]`` of them;
    what an all_reduce followed by a slice gives, for half the bytes): this rank's summed rows, padded to the
    largest piece, in flight until ``reduce_scatter_wait``."""
    largest = max(sizes)
    pieces = x.movedim(dim, 0).split(sizes)
    padded = [piece if piece.shape[0] == largest else
              torch.cat([piece, piece.new_zeros((largest - piece.shape[0], *piece.shape[1:]))]) for piece in pieces]
    return functional.reduce_scatter_tensor(torch.cat(padded).contiguous(), "sum", len(sizes), group_name)


def reduce_scatter_wait(issued: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Wait for an issued ``reduce_scatter`` and keep this rank's ``size`` rows."""
    return functional.wait_tensor(issued)[:size].movedim(0, dim)


def _received_shapes(shape: list[int], scatter_dim: int, gather_dim: int, scatter_sizes: list[int],
                     gather_sizes: list[int], index: int) -> list[list[int]]:
    """The shape of the piece each rank sends this one: its rows of ``gather_dim``, this rank's of ``scatter_dim``."""
    shapes = []
    for size in gather_sizes:
        piece = list(shape)
        piece[gather_dim], piece[scatter_dim] = size, scatter_sizes[index]
        shapes.append(piece)
    return shapes


def _flat_concatenation(pieces: list[torch.Tensor], whole: torch.Tensor, dim: int) -> torch.Tensor:
    """The pieces of ``whole`` along ``dim``, flattened end to end: ``whole`` itself, flattened, where only unit dims
    precede ``dim`` (each piece is then a run of its memory, in order: no copy); else a copy."""
    if all(size == 1 for size in whole.shape[:dim]):
        return whole.reshape(-1)
    if len({piece.shape for piece in pieces}) == 1:  # stacked: each piece copied over its own dims
        return torch.stack(pieces).reshape(-1)
    return torch.cat([piece.reshape(-1) for piece in pieces])


def all_to_all_start(x: torch.Tensor, scatter_dim: int, gather_dim: int, scatter_sizes: list[int],
                     gather_sizes: list[int], index: int, order: list[int] | None, group_name: str,
                     exchange_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Issue the move of ``x``'s sharding from ``gather_dim`` to ``scatter_dim`` (Ulysses: sequence <-> heads).

    This rank (``index`` in its group) holds ``gather_sizes[index]`` rows of ``gather_dim`` and all of
    ``scatter_dim``; it sends rank j its ``scatter_sizes[j]`` rows of ``scatter_dim`` and receives from rank i
    ``gather_sizes[i]`` rows of ``gather_dim``. Pieces travel flattened with their dims in ``order`` (a permutation,
    the same on every rank: the value's memory order, so a piece split off its outermost dim travels without a
    copy), so uneven sizes on both dims work; the received pieces, end to end, are in flight until
    ``all_to_all_wait``. With ``exchange_dtype`` (``partition(..., exchange_dtype=)``) each piece travels in it,
    with per-row scales for a float8 dtype (``low_precision``)."""
    order = order or list(range(x.dim()))
    x, scatter_dim, gather_dim = x.permute(order), order.index(scatter_dim), order.index(gather_dim)
    shapes = _received_shapes(list(x.shape), scatter_dim, gather_dim, scatter_sizes, gather_sizes, index)
    if low_precision.applies(x.dtype, exchange_dtype):
        rows = low_precision.row_dim(x.shape, scatter_dim, gather_dim)
        pieces = [low_precision.encode(piece, exchange_dtype, rows) for piece in x.split(scatter_sizes, scatter_dim)]
        received = [low_precision.encoded_bytes(shape, exchange_dtype, rows) for shape in shapes]
        return functional.all_to_all_single(torch.cat(pieces), received, [p.numel() for p in pieces], group_name)
    pieces = x.split(scatter_sizes, dim=scatter_dim)
    return functional.all_to_all_single(_flat_concatenation(pieces, x, scatter_dim), [math.prod(s) for s in shapes],
                                        [piece.numel() for piece in pieces], group_name)


def all_to_all_wait(issued: torch.Tensor, shape: list[int], scatter_dim: int, gather_dim: int,
                    scatter_sizes: list[int], gather_sizes: list[int], index: int, order: list[int] | None,
                    exchange_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Wait for an issued ``all_to_all`` of a value of ``shape`` (this rank's) and join the pieces along
    ``gather_dim`` (in ``order``, as they were sent, then put back in the value's order: a view). Pieces sent in
    ``exchange_dtype`` are restored to ``dtype``, the value's."""
    order = order or list(range(len(shape)))
    in_place = joined_in_place(shape, scatter_dim, gather_dim, scatter_sizes, index, order)
    shape = [shape[dim] for dim in order]
    scatter_dim, gather_dim = order.index(scatter_dim), order.index(gather_dim)
    shapes = _received_shapes(shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, index)
    received = functional.wait_tensor(issued)
    if low_precision.applies(dtype, exchange_dtype):
        rows = low_precision.row_dim(shape, scatter_dim, gather_dim)
        parts = received.split([low_precision.encoded_bytes(piece, exchange_dtype, rows) for piece in shapes])
        joined = torch.cat([low_precision.decode(part, piece, exchange_dtype, dtype, rows)
                            for part, piece in zip(parts, shapes)], dim=gather_dim)
    elif in_place:
        joined = list(shapes[0])
        joined[gather_dim] = sum(piece[gather_dim] for piece in shapes)
        joined = received.view(joined)
    else:
        parts = received.split([math.prod(s) for s in shapes])
        joined = torch.cat([part.view(piece) for part, piece in zip(parts, shapes)], dim=gather_dim)
    return joined.permute([order.index(dim) for dim in range(len(order))])


def joined_in_place(shape: list[int], scatter_dim: int, gather_dim: int, scatter_sizes: list[int], index: int,
                    order: list[int] | None) -> bool:
    """Whether an all_to_all's received pieces, end to end, are already the joined value (``all_to_all_wait``
    returns a view of them): only unit dims travel before the joined one (a batch of one, then the rows)."""
    order = order or list(range(len(shape)))
    sizes = {**dict(enumerate(shape)), scatter_dim: scatter_sizes[index]}  # (what this rank keeps of scatter_dim)
    return all(sizes[dim] == 1 for dim in order[:order.index(gather_dim)])


# What issues a collective of this package's (it holds what it sends, a copy of its input or the input itself,
# until the wait)
STARTS = (all_gather_start, reduce_scatter_start, all_to_all_start)
# What waits for an issued collective (its first argument: the node that issued it); the result is a view of the
# buffer the collective filled, but for an uneven all_gather's trimmed rows and an all_to_all's pieces joined by a
# copy (not ``joined_in_place``; the report counts every all_to_all wait as a value of its own: ``aliases``)
WAITS = (functional.wait_tensor.default, all_gather_wait, reduce_scatter_wait, all_to_all_wait)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Statistics in float32 at least, as torch's kernels compute them for half types."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _sum_over_ranks(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if kernel_gradients.recording(x):
        return kernel_gradients.sum_over_ranks(x, group_name)
    return functional.wait_tensor(functional.all_reduce(x, "sum", group_name))


def _all_to_all_single(x: torch.Tensor, sizes_in: list[int], sizes_out: list[int], group_name: str) -> torch.Tensor:
    """A point-to-point exchange (ring step, halo), done: with gradients, they return the way the data came."""
    if kernel_gradients.recording(x):
        return kernel_gradients.permuted(x, sizes_in, sizes_out, group_name)
    return functional.wait_tensor(functional.all_to_all_single(x, sizes_in, sizes_out, group_name))


def sharded_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, size: int,
                     group_name: str) -> torch.Tensor:
    """``rms_norm`` over a last dim of ``size`` features of which this rank holds a shard (q/k projections normed
    across all heads, as Wan and LTX-Video do): the sum of squares of each row is reduced over the ranks (one
    all_reduce of ``[rows, 1]``), then each rank scales its own features. Statistics in float32, as torch's kernel."""
    wide = _wide(x)
    eps = torch.finfo(wide.dtype).eps if eps is None else eps  # torch's default: the compute dtype's epsilon
    squares = _sum_over_ranks(wide.square().sum(-1, keepdim=True), group_name)
    out = (wide * torch.rsqrt(squares / size + eps)).to(x.dtype)
    return out if weight is None else out * weight


def sharded_layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                       size: int, group_name: str) -> torch.Tensor:
    """``layer_norm`` over a sharded last dim: the mean, then the variance around it, each one all_reduce of
    ``[rows, 1]`` (two passes, as exact as the one-device kernel's)."""
    wide = _wide(x)
    mean = _sum_over_ranks(wide.sum(-1, keepdim=True), group_name) / size
    centered = wide - mean
    variance = _sum_over_ranks(centered.square().sum(-1, keepdim=True), group_name) / size
    out = (centered * torch.rsqrt(variance + eps)).to(x.dtype)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


QUERY_CHUNK = 1024  # query rows per score matrix where no fused kernel returns the log-sum-exp


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An attention mask as scores to add: a boolean one (True attends) as 0 / -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     fused: bool | None = None, mask: torch.Tensor | None = None):
    """Attention of all queries over one block of keys: (output, log-sum-exp of the scores per query row), both in
    float32 at least; a query row whose keys in this block are all masked out has log-sum-exp -inf and output 0.
    The fused CPU kernel returns the log-sum-exp; elsewhere it is computed from the scores, ``QUERY_CHUNK`` query
    rows at a time so that a score matrix stays ``[heads, QUERY_CHUNK, block rows]`` (a fused kernel with the
    log-sum-exp is still to be used there). ``fused`` overrides the choice (tests). ``mask``: additive, this
    block's columns."""
    wide_q = _wide(q)
    if mask is not None and mask.dim() < 4:  # as SDPA broadcasts it, aligned to the last dims (the fused kernel
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # takes 2 or 4: HunyuanVideo 1.5's is 3)
    if q.device.type == "cpu" if fused is None else fused:  # (half types widened: merged before any rounding)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(wide_q, _wide(k), _wide(v), 0.0,
                                                                             False, attn_mask=mask, scale=scale)
        lse = lse.float()
        if mask is not None:  # (the kernel gives such rows a log-sum-exp of 0)
            lse = lse.masked_fill(torch.isneginf(mask).all(-1).expand(lse.shape), float("-inf"))
        return out, lse
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys, values = _wide(k).transpose(-2, -1), _wide(v)
    outs, lses = [], []
    for start, rows in zip(range(0, q.shape[-2], QUERY_CHUNK), wide_q.split(QUERY_CHUNK, dim=-2)):
        scores = rows @ keys * scale
        if mask is not None:
            scores = scores + (mask if mask.shape[-2] == 1 else mask[..., start:start + rows.shape[-2], :])
        # rows masked out over this whole block: scores of 0 stand in (a softmax of -inf only would give NaN, and
        # so would its gradient), their output and log-sum-exp set after
        dead = torch.isneginf(scores).all(-1, keepdim=True)
        scores = scores.masked_fill(dead, 0.0)
        lses.append(torch.logsumexp(scores, dim=-1).masked_fill(dead.squeeze(-1), float("-inf")))
        outs.append((torch.softmax(scores, dim=-1) @ values).masked_fill(dead, 0.0))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _merge_weights(lse: torch.Tensor, block_lse: torch.Tensor):
    """The online softmax's merge of two partial results by their log-sum-exps: (the merged log-sum-exp, the
    running output's weight, the block's weight). A row masked out in both stays -inf with weights 0, computed so
    that its gradient is 0 too (logaddexp of two -inf has a NaN one)."""
    both = torch.isneginf(lse) & torch.isneginf(block_lse)
    merged = torch.logaddexp(lse.masked_fill(both, 0.0), block_lse.masked_fill(both, 0.0))
    merged = merged.masked_fill(both, float("-inf"))
    finite = merged.masked_fill(both, 0.0)
    return merged, torch.exp(lse - finite).unsqueeze(-1), torch.exp(block_lse - finite).unsqueeze(-1)


def _pass_on(k: torch.Tensor, v: torch.Tensor, incoming: tuple[int, ...], ranks: int, index: int,
             group_name: str, recording: bool = False):
    """Launch the ring step: send this rank's key/value block to the next rank and receive the previous rank's
    block (``incoming``: its k and v shapes' row counts and the elements they hold). One all_to_all_single whose
    only non-empty pieces go to the next rank and come from the previous one: a collective-permute that sizes
    each message exactly (uneven blocks need no padding). Returns what receives the block: a wait for the transfer
    in flight, or, with gradients (``recording``: the exchange paired with its backward), the block received."""
    send = torch.cat([k.reshape(-1), v.reshape(-1)])
    sizes_out, sizes_in = [0] * ranks, [0] * ranks
    sizes_out[(index + 1) % ranks] = send.numel()
    sizes_in[(index - 1) % ranks] = sum(incoming)  # (on a ring of 2 the same rank as the next)
    if recording:
        received = kernel_gradients.permuted(send, sizes_in, sizes_out, group_name)
        return lambda: received
    pending = functional.all_to_all_single(send, sizes_in, sizes_out, group_name)
    return lambda: functional.wait_tensor(pending)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, rows: list[int],
                   index: int, group_name: str, mask: torch.Tensor | None = None,
                   mask_columns: list[list[tuple[int, int]]] | None = None) -> torch.Tensor:
    """Attention over a sequence whose keys and values are split over a ring of ``len(rows)`` ranks (``rows[i]``:
    the key rows rank i holds); this rank (``index``) keeps its query rows. The key/value blocks travel round the
    ring: at each step the next block's transfer is launched before this block's attention runs (overlap), and the
    partial results are merged exactly by their log-sum-exp (the online softmax):
    out = sum_i out_i * exp(lse_i - lse), lse = logsumexp_i(lse_i).
    With gradients the merge is out of place, each block's log-sum-exp computed by differentiable ops (the fused
    kernel's is not) and the blocks' gradients return round the ring: exact, without the overlap.
    ``mask``: this rank's query rows over every key column, in the sequence's order; ``mask_columns[i]``: the
    columns rank i's key rows are (its part of each block of a packed sequence), picked at the step its block is
    here. A query row masked out over every key gives 0, as scaled_dot_product_attention does. Keys and values
    with fewer heads than the queries (grouped-query attention) travel as they are."""
    ranks = len(rows)
    shape_k, shape_v = list(k.shape), list(v.shape)
    mask = _additive(mask, torch.promote_types(_wide(q).dtype, torch.float32))
    out = lse = None
    recording = kernel_gradients.recording(q, k, v)
    holder = index  # whose block this rank holds now
    for step in range(ranks):
        receive = None
        if step < ranks - 1:
            source = (holder - 1) % ranks
            shape_k[-2] = shape_v[-2] = rows[source]
            incoming = (math.prod(shape_k), math.prod(shape_v))
            receive = _pass_on(k, v, incoming, ranks, index, group_name, recording)
        block_mask = None if mask is None else torch.cat([mask[..., a:b] for a, b in mask_columns[holder]], -1)
        block_out, block_lse = _attention_block(q, _query_heads(k, q), _query_heads(v, q), scale,
                                                fused=False if recording else None, mask=block_mask)
        if out is None:
            out, lse = block_out, block_lse
        else:
            lse, kept, added = _merge_weights(lse, block_lse)
            if recording:  # (autograd needs the outputs it saved)
                out = out * kept + block_out * added
            else:  # in place: the running output and this block's are the only float32 buffers held
                out = out.mul_(kept).add_(block_out.mul_(added))
        if receive is not None:
            k_part, v_part = receive().split(list(incoming))
            k, v = k_part.view(shape_k), v_part.view(shape_v)
            holder = source
    return out.to(q.dtype)


def _query_heads(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention's keys or values, one head per query head (query head h reads key/value head
    h // group, as ``enable_gqa`` does): the ring passes the fewer heads, each block is widened here."""
    group = q.shape[1] // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _borrow_rows(x: torch.Tensor, dim: int, before: int, after: int, index: int, ranks: int,
                 group_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``before`` rows ahead of this rank's own along ``dim`` (the previous rank's last) and the ``after`` rows
    past them (the next rank's first), None at the image's edges: one all_to_all_single whose only non-empty pieces
    go to and come from the two neighbours (a halo exchange)."""
    rows = x.shape[dim]
    came = {index - 1: before if index > 0 else 0, index + 1: after if index + 1 < ranks else 0}
    sent = {index - 1: after if index > 0 else 0, index + 1: before if index + 1 < ranks else 0}  # what each needs
    inner = x.numel() // rows
    send = torch.cat([x.narrow(dim, 0, sent[index - 1]).reshape(-1),
                      x.narrow(dim, rows - sent[index + 1], sent[index + 1]).reshape(-1)])
    received = _all_to_all_single(send, [came.get(r, 0) * inner for r in range(ranks)],
                                  [sent.get(r, 0) * inner for r in range(ranks)], group_name)
    pieces = received.split([came[index - 1] * inner, came[index + 1] * inner])

    def shaped(piece: torch.Tensor, count: int) -> torch.Tensor | None:
        shape = list(x.shape)
        shape[dim] = count
        return piece.view(shape) if count else None
    return shaped(pieces[0], came[index - 1]), shaped(pieces[1], came[index + 1])


PAD_MODES = ("constant", "replicate", "reflect")


def _edge(x: torch.Tensor, dim: int, count: int, first: bool, mode: str) -> torch.Tensor:
    """``count`` rows of padding past the image's first (or last) row along ``dim``, as ``F.pad``'s ``mode`` makes
    them: zeros, copies of the edge row, or the rows next to it mirrored."""
    rows = x.shape[dim]
    if mode == "replicate":
        return x.narrow(dim, 0 if first else rows - 1, 1).expand(*x.shape[:dim], count, *x.shape[dim + 1:])
    if mode == "reflect":
        return x.narrow(dim, 1 if first else rows - 1 - count, count).flip(dim)
    shape = list(x.shape)
    shape[dim] = count
    return x.new_zeros(shape)


def _around(x: torch.Tensor, dim: int, ahead: torch.Tensor | None, behind: torch.Tensor | None, before: int,
            after: int, mode: str = "constant") -> torch.Tensor:
    """``x`` with the borrowed rows around it along ``dim`` (the padding of ``mode`` where there is no neighbour)."""
    return torch.cat([ahead if ahead is not None else _edge(x, dim, before, True, mode), x,
                      behind if behind is not None else _edge(x, dim, after, False, mode)], dim)


def halo_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                     padding: list[list[int]], dilation: list[int], groups: int, dim: int, index: int, ranks: int,
                     group_name: str, mode: str = "constant") -> torch.Tensor:
    """A convolution along ``dim``, whose rows are split in order over ``ranks`` ranks (this one ``index``), each
    rank computing the output rows of its own rows (``rows / stride`` of them). ``padding``: ``[before, after]`` per
    spatial dim. Along ``dim`` a rank reads ``before`` rows ahead of its own (the previous rank's last; zeros, the
    convolution's padding, on the first rank) and ``after`` rows past them (the next rank's first; zeros on the
    last; replicate or reflect ``mode`` pads the image's edges as ``F.pad`` does), borrowed in one halo exchange
    (``_borrow_rows``).

    A same-size convolution (stride 1, the same padding on both sides of every dim) runs on this rank's rows with
    its own zero padding, and only the edge rows facing a neighbour are computed again from the borrowed rows, in
    place: no padded copy of the input is made (at a VAE's full resolution that copy would be this rank's largest
    buffer). Others (strided downsampling) convolve this rank's rows with the borrowed ones around them."""
    rows, (before, after) = x.shape[dim], padding[dim - 2]
    ahead, behind = _borrow_rows(x, dim, before, after, index, ranks, group_name)

    def convolve(rows_in: torch.Tensor, pad: list[int]) -> torch.Tensor:
        return torch.ops.aten.convolution.default(rows_in, weight, bias, stride, pad, dilation, False,
                                                  [0] * len(pad), groups)

    symmetric = [p if p == q else None for p, q in padding]
    if stride[dim - 2] != 1 or None in symmetric or rows < 2 * before or mode != "constant":
        others = [side for d, pair in reversed(list(enumerate(padding))) for side in (pair if d != dim - 2 else (0, 0))]
        rows_in = _around(x, dim, ahead, behind, before, after, mode)
        return convolve(torch.nn.functional.pad(rows_in, others, mode=mode) if any(others) else rows_in,
                        [0] * len(padding))
    unpadded = list(symmetric)
    unpadded[dim - 2] = 0
    out = convolve(x, symmetric)  # right but for the edge rows that face a neighbour
    if ahead is not None:
        out.narrow(dim, 0, before).copy_(convolve(torch.cat([ahead, x.narrow(dim, 0, 2 * before)], dim), unpadded))
    if behind is not None:
        edge = torch.cat([x.narrow(dim, rows - 2 * after, 2 * after), behind], dim)
        out.narrow(dim, rows - after, after).copy_(convolve(edge, unpadded))
    return out


def halo_transposed_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                stride: list[int], padding: list[int], output_padding: list[int], groups: int,
                                dilation: list[int], dim: int, before: int, after: int, index: int, ranks: int,
                                group_name: str) -> torch.Tensor:
    """A transposed convolution (upsampling by ``stride``) along ``dim``, whose input rows are split in order over
    ranks: each rank computes the ``rows * stride`` output rows of its own rows. Those also receive from the
    ``before`` input rows ahead of its own and the ``after`` rows past them (borrowed from its neighbours; no rows,
    so nothing, past the signal's ends): the transposed convolution runs unpadded along ``dim`` over them all and
    this rank's output rows are cut from the result."""
    rows, step, pad = x.shape[dim], stride[dim - 2], padding[dim - 2]
    ahead, behind = _borrow_rows(x, dim, before, after, index, ranks, group_name)
    unpadded, no_extra = list(padding), list(output_padding)
    unpadded[dim - 2] = no_extra[dim - 2] = 0
    out = torch.ops.aten.convolution.default(_around(x, dim, ahead, behind, before, after), weight, bias, stride,
                                             unpadded, dilation, True, no_extra, groups)
    return out.narrow(dim, pad + before * step, rows * step)


_INTERPOLATE = {"linear": torch.ops.aten.upsample_linear1d.vec, "bilinear": torch.ops.aten.upsample_bilinear2d.vec,
                "trilinear": torch.ops.aten.upsample_trilinear3d.vec, "bicubic": torch.ops.aten.upsample_bicubic2d.vec}


def halo_interpolation(x: torch.Tensor, mode: str, scale_factors: list[float], dim: int, reach: int, index: int,
                       ranks: int, group_name: str) -> torch.Tensor:
    """Interpolating upsampling (linear, bilinear, trilinear: ``reach`` 1; bicubic: 2) by a whole factor along
    ``dim``, whose rows are split in order over ranks, corners not aligned: each output row reads the input rows
    around its source position, so a rank borrows ``reach`` rows from each neighbour, pads the image's edges by
    repeating its edge row (what the op's clamped indices read there), upsamples and keeps its own
    ``rows * factor`` output rows."""
    ahead, behind = _borrow_rows(x, dim, reach, reach, index, ranks, group_name)
    out = _INTERPOLATE[mode](_around(x, dim, ahead, behind, reach, reach, "replicate"), None, False, scale_factors)
    factor = int(scale_factors[dim - (x.dim() - len(scale_factors))])
    return out.narrow(dim, reach * factor, x.shape[dim] * factor)


def padded_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                       padding: list[list[int]], dilation: list[int], groups: int,
                       mode: str = "constant") -> torch.Tensor:
    """A convolution whose padding differs on the two sides of some dim (``padding``: ``[before, after]`` per
    spatial dim) or is not zeros (``mode``: ``F.pad``'s): ``F.pad`` then a convolution, as a VAE's strided
    downsampling or a reflect-padded encoder writes it (``fold_conv_padding`` makes it one op, so that a split
    dim's padding goes only to the image's edges, ``halo_convolution``)."""
    pads = [side for pair in reversed(padding) for side in pair]
    return torch.ops.aten.convolution.default(torch.nn.functional.pad(x, pads, mode=mode), weight, bias, stride,
                                              [0] * len(padding), dilation, False, [0] * len(padding), groups)


def sharded_group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float, group_name: str) -> torch.Tensor:
    """``group_norm`` of a value whose spatial positions are split over ranks (any per-rank count): each rank's
    per-group count, mean and spread (``var_mean``, no copy of ``x``) are combined across ranks as parallel
    variance does (Chan et al.): two all_reduces of ``[batch, groups]``. Then one pass ``x * scale + shift``
    with the statistics and the affine folded per channel. Statistics in float32 at least, as torch's kernel."""
    batch, channels = x.shape[:2]
    wide = _wide(x).reshape(batch, groups, -1)
    count = wide.new_full((), wide.shape[-1])
    variance, mean = torch.var_mean(wide, dim=-1, correction=0)
    total = _sum_over_ranks(torch.stack([mean * count, count.expand_as(mean)]), group_name)
    global_mean = total[0] / total[1]
    spread = _sum_over_ranks(count * (variance + (mean - global_mean).square()), group_name)
    rstd = torch.rsqrt(spread / total[1] + eps)
    per_channel = channels // groups
    scale = rstd.repeat_interleave(per_channel, dim=1)
    shift = -global_mean.repeat_interleave(per_channel, dim=1) * scale
    if weight is not None:
        scale, shift = scale * weight, shift * weight
    if bias is not None:
        shift = shift + bias
    trailing = [1] * (x.dim() - 2)
    out = torch.addcmul(shift.view(batch, channels, *trailing), _wide(x), scale.view(batch, channels, *trailing))
    return out.to(x.dtype)
