"""Ops written out so that XLA keeps their operands sharded (Linear and attention as einsums, layer_norm as
reductions over its dims), and the ops that act on packed values in their rank-major layout without moving data."""

from __future__ import annotations

import math

import torch

from ...placement import PackedShard
from .errors import XlaBackendError
from .layouts import Packed, _fused

aten = torch.ops.aten
_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}


def _linear(x, weight, bias=None):
    """``aten.linear`` as an einsum over the last dim (no batch flattening). A weight packed on its rows gives a
    packed output; one packed on its input features contracts a packed input over both of its dims at once."""
    if isinstance(weight, Packed) and weight.dim == 0:  # [ranks, rows, in]
        out = torch.einsum("...i,rmi->...rm", _fused(x), weight.tensor)
        return Packed(out if bias is None else out + bias.tensor, out.dim() - 2, weight.blocks)
    if isinstance(weight, Packed):  # [out, ranks, m]
        if not isinstance(x, Packed):
            x = Packed.from_blocks(x.split(list(weight.blocks), -1), x.dim() - 1, weight.ranks)
        if (x.blocks, x.ranks) != (weight.blocks, weight.ranks):  # else the contraction would pair wrong features
            raise XlaBackendError(f"a packed input {list(x.blocks)} over {x.ranks} ranks meets a weight packed "
                                  f"{list(weight.blocks)} over {weight.ranks}")
        out = torch.einsum("...rm,orm->...o", x.tensor, weight.tensor)
    else:
        out = torch.einsum("...i,oi->...o", _fused(x), weight)
    return out if bias is None else out + bias


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """Scaled dot-product attention as einsums over (batch, heads, seq, head_dim), batch and heads kept apart."""
    if attn_mask is not None or dropout_p or is_causal or enable_gqa:
        return aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("...qd,...kd->...qk", q, k) * scale
    return torch.einsum("...qk,...kd->...qd", scores.softmax(-1), v)


def _ring_blocks(x, ring: int):
    """``[batch, heads, seq, d]`` as ``[batch, heads, ring, seq / ring, d]``: the ring's blocks on their own dim."""
    return x.unflatten(2, (ring, x.shape[2] // ring))


def _pass_on(blocks):
    """Every rank's block to the next rank of the ring: the block dim rolled one place, written as the two slices
    XLA's partitioner recognises as a rotation of a sharded dim (one collective-permute; ``torch.roll`` becomes
    all-gathers and all-to-alls)."""
    return torch.cat([blocks[:, :, -1:], blocks[:, :, :-1]], dim=2)


def _ring_attention(q, k, v, scale, ring: int, annotate):
    """Ring attention in SPMD form: q, k and v hold their sequence as ``ring`` equal blocks on a dim the ring axis
    shards (``annotate(tensor)`` lays a 5-d value out so), each rank its block. At every step the key/value blocks
    move one place along that dim (``_pass_on``), which XLA's partitioner turns into one collective-permute between
    ring neighbours; each rank attends its query block over the key block it holds (the block dim is a batch dim of
    the einsums: no communication) and merges the partial results by their log-sum-exp, as
    ``collectives.ring_attention`` does, in float32 (each step's exchange is not overlapped with its compute
    here: XLA schedules it)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    queries = annotate(_ring_blocks(q.to(wide), ring))
    blocks = annotate(torch.cat([_ring_blocks(k.to(wide), ring), _ring_blocks(v.to(wide), ring)], -1))
    out = lse = None
    for step in range(ring):
        if step:
            blocks = annotate(_pass_on(blocks))
        keys, values = blocks[..., :k.shape[-1]], blocks[..., k.shape[-1]:]
        scores = annotate(torch.einsum("bhnqd,bhnkd->bhnqk", queries, keys) * scale)
        block_lse = annotate(torch.logsumexp(scores, -1))
        block_out = annotate(torch.einsum("bhnqk,bhnkd->bhnqd", scores.softmax(-1), values))
        if out is None:
            out, lse = block_out, block_lse
        else:
            top = torch.maximum(lse, block_lse)  # logaddexp, written out (torch_xla runs logaddexp on the host)
            merged = annotate(top + torch.log(torch.exp(lse - top) + torch.exp(block_lse - top)))
            out = annotate(out * torch.exp(lse - merged).unsqueeze(-1)
                           + block_out * torch.exp(block_lse - merged).unsqueeze(-1))
            lse = merged
    return out.flatten(2, 3).to(q.dtype)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """``layer_norm`` as reductions over its own dims: torch_xla lowers it to batch-norm with the rows as features,
    which XLA's SPMD partitioner cannot keep sharded (it gathers the rows, then slices them again)."""
    dims = tuple(range(-len(normalized_shape), 0))
    wide = x.float()  # statistics in float32, as torch's kernels compute them for bf16/fp16
    centered = wide - wide.mean(dims, keepdim=True)
    out = (centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)).to(x.dtype)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def _split_packed(target, value: Packed, args, kwargs):
    """A chunk/split of a packed value exactly into its blocks: no data moves. None for any other split (the caller
    then splits the fused value)."""
    sizes = list(value.blocks)
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % (value.tensor.dim() - 1)
    pieces = args[1]
    if target is aten.chunk.default:
        into_blocks = pieces == len(sizes) and len(set(sizes)) == 1
    elif target is aten.split.Tensor:
        into_blocks = all(size == pieces for size in sizes)
    else:
        into_blocks = list(pieces) == sizes
    return value.split() if dim == value.dim and into_blocks else None


def _pointwise_packed(target, args, kwargs) -> Packed | None:
    """A pointwise op on packed values of one layout and scalars (a scale, a cast, SwiGLU's own activation) acts on
    the rank-major tensors as they are. None otherwise."""
    if not (torch.Tag.pointwise in getattr(target, "tags", ()) or target in _CASTS):
        return None
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    packed = [a for a in leaves if isinstance(a, Packed)]
    layout = {(p.dim, p.blocks, tuple(p.tensor.shape)) for p in packed}
    if len(layout) != 1 or any(isinstance(a, torch.Tensor) and a.dim() for a in leaves):
        return None
    args, kwargs = torch.fx.node.map_aggregate((args, kwargs), lambda a: a.tensor if isinstance(a, Packed) else a)
    return Packed(target(*args, **kwargs), packed[0].dim, packed[0].blocks)


def _cat_as_packed(tensors, dim: int, placement: PackedShard, ranks: int) -> Packed | None:
    """A cat whose result the plan packs (Flux: ``cat([attention, mlp])`` before a row-wise Linear): its inputs
    become the blocks."""
    if any(isinstance(t, Packed) for t in tensors):
        return None
    dim %= tensors[0].dim()
    if placement.dim % tensors[0].dim() != dim or [t.shape[dim] for t in tensors] != list(placement.blocks):
        return None
    return Packed.from_blocks(tensors, dim, ranks)


def _tensor_dims(value: Packed, dim: int) -> list[int]:
    """Where a dim of the value sits in its rank-major tensor: the packed dim is two (ranks, rows)."""
    return [dim, dim + 1] if dim == value.dim else [dim + (dim > value.dim)]


def _moved_packed(target, args) -> Packed | None:
    """A permute or squeeze of a packed value (a 1x1 convolution read as a linear: its squeezed weight, its
    channels moved last and back) on the rank-major tensor, the rank dim moving with the packed dim. None when the
    op is another or touches the packed dim."""
    value = args[0]
    if not isinstance(value, Packed):
        return None
    ndim = value.tensor.dim() - 1
    if target is aten.permute.default:
        order = [d % ndim for d in args[1]]
        moved = value.tensor.permute([t for d in order for t in _tensor_dims(value, d)])
        return Packed(moved, order.index(value.dim), value.blocks)
    if target is aten.squeeze.dims:  # (torch keeps a listed dim whose size is not 1)
        dims = [d % ndim for d in args[1] if value.tensor.shape[_tensor_dims(value, d % ndim)[-1]] == 1]
        if value.dim in dims:
            return None
        squeezed = value.tensor.squeeze([t for d in dims for t in _tensor_dims(value, d)])
        return Packed(squeezed, value.dim - sum(d < value.dim for d in dims), value.blocks)
    return None


def _grouped_conv_packed(target, args) -> Packed | None:
    """A grouped convolution over packed channels (Sana's depthwise convolution between its two 1x1 ones): the
    rank-major channels are a permutation of whole groups, its weight and bias permuted alike, so it runs on them
    as they are. None for anything else."""
    x, weight, bias = (*args[:3], None)[:3]
    if not (isinstance(x, Packed) and x.dim == 1 and isinstance(weight, Packed) and weight.dim == 0
            and (x.blocks, x.ranks) == (weight.blocks, weight.ranks) and len(args) > 6
            and (bias is None or isinstance(bias, Packed))):
        return None
    out = target(x.tensor.flatten(1, 2), weight.tensor.flatten(0, 1),
                 None if bias is None else bias.tensor.flatten(0, 1), *args[3:])
    return Packed(out.unflatten(1, (x.ranks, -1)), 1, x.blocks)
