"""Ops of convolutional networks (a VAE's decoder and encoder) over images or videos whose rows are split along a
spatial dim (height by default):

- ``group_norm`` normalises each sample's groups of channels over every spatial position: with a spatial dim split
  over a sequence axis each rank's statistics are combined across ranks (``collectives.sharded_group_norm``, put
  in by ``collective_kernels``); split along the batch it is local; split channels would change its groups;
- nearest upsampling by a whole factor gives every output row from one input row of the same rank: rank ``r``'s
  rows scale to rank ``r``'s rows, so a shard in units of ``u`` rows becomes one in units of ``u * factor`` (a
  split 4 + 3 of 7 latent rows is 8 + 6 of 14); interpolating modes (linear to bicubic) too, each rank borrowing
  the one or two rows past its own that its last output rows read (``collectives.halo_interpolation``);
- depth-to-space and space-to-depth (``pixel_shuffle``, ``pixel_unshuffle``) scale rows alike;
- ``batch_norm`` in eval mode scales each channel by its running statistics: any split but the channels' passes.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..mesh import SEQUENCE_AXES
from ..placement import PackedShard, boundary_unit, is_sharded, packed_shard, shard_widths, unit_of
from .core import Decision, NeedsUnit, R, Unshardable, register, register_factory, same_as_input, shape_of

aten = torch.ops.aten

_GROUP_NORM = aten.group_norm.default


def group_norm(node: Node, placements, axis_size: int, spatial: bool) -> Decision:
    """``group_norm(x, groups, weight, bias, eps)``: a sharded batch passes; a sharded spatial dim (``spatial``: on a
    sequence axis, whose statistics a collective combines) passes with weight and bias whole."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement) or placement.dim == 0:
        return decision
    if placement.dim == 1:
        raise Unshardable("group_norm over sharded channels (its groups would change)")
    if not spatial:
        raise Unshardable(f"group_norm normalises over the sharded spatial dim {placement.dim}")
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        raise Unshardable("group_norm over a spatial dim packed from several parts")
    return decision


@register_factory(_GROUP_NORM, axis="sequence")
def make_sequence_group_norm(roles, axis: str | None = None):
    del roles
    return lambda node, placements, axis_size: group_norm(node, placements, axis_size, spatial=axis in SEQUENCE_AXES)


register(_GROUP_NORM)(lambda node, placements, axis_size: group_norm(node, placements, axis_size, spatial=False))

@register(aten.batch_norm.default)
def batch_norm(node: Node, placements, axis_size: int) -> Decision:
    """``batch_norm(x, weight, bias, running_mean, running_var, training, ...)`` in eval mode scales each channel by
    its running statistics: row by row, so a split batch or spatial dim passes (weights whole). In training mode
    it takes statistics over the batch and every position: refused over any split; so are split channels."""
    source, training = node.args[0], node.args[5]
    placement = placements.get(source, R)
    if is_sharded(placement) and (training or placement.dim == 1):
        raise Unshardable("batch_norm over " + ("a split value in training mode (its statistics span every row)"
                                                if training else "split channels"))
    return same_as_input(node, placements, source)


# nearest upsampling ops -> how many trailing spatial dims they scale
NEAREST = {aten.upsample_nearest1d.vec: 1, aten.upsample_nearest2d.vec: 2, aten.upsample_nearest3d.vec: 3,
            aten._upsample_nearest_exact1d.vec: 1, aten._upsample_nearest_exact2d.vec: 2,
            aten._upsample_nearest_exact3d.vec: 3, aten.upsample_nearest1d.default: 1,
            aten.upsample_nearest2d.default: 2, aten.upsample_nearest3d.default: 3}


@register(*NEAREST)
def nearest_upsampling(node: Node, placements, axis_size: int) -> Decision:
    """Nearest (or nearest-exact) upsampling: every output row of a sharded dim repeats one input row of the same
    rank when the output is a whole multiple of the input (nearest-exact's half-pixel offset stays inside the
    input row's copies too): the shard's unit grows by the factor. A fractional factor maps rows across ranks."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement) or placement.dim < 2:
        return decision
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        raise Unshardable("upsampling a spatial dim packed from several parts")
    rows, out = shape_of(source)[placement.dim], shape_of(node)[placement.dim]
    factor = _factor(node, placement.dim)
    if out % rows or (factor is not None and factor != out // rows):
        raise Unshardable(f"nearest upsampling of the sharded dim {placement.dim} from {rows} to {out} rows (not a "
                          "whole factor): output rows would come from other ranks' rows")
    return Decision(packed_shard(placement.dim, (out,), unit_of(placement) * (out // rows), axis_size),
                    decision.inputs)


def _factor(node: Node, dim: int) -> float | None:
    """The scale factor the op itself uses for ``dim`` (its index computation follows it, not the sizes), if given."""
    index = dim - (len(shape_of(node.args[0])) - NEAREST[node.target])
    if node.target._overloadname == "vec":
        scales = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_factors")
    else:
        scales = list(node.args[2:])
    return scales[index] if scales is not None and index < len(scales) else None


# interpolating upsampling: its mode, and how many rows past its own an output row's source position reads
INTERPOLATING = {aten.upsample_linear1d.vec: ("linear", 1), aten.upsample_bilinear2d.vec: ("bilinear", 1),
                 aten.upsample_trilinear3d.vec: ("trilinear", 1), aten.upsample_bicubic2d.vec: ("bicubic", 2)}


def interpolating_upsampling(node: Node, placements, axis_size: int, exchange: bool) -> Decision:
    """``upsample_{linear,bilinear,trilinear,bicubic}(x, None, align_corners=False, scale_factors)`` by a whole
    factor along a split spatial dim: each rank's rows scale to its own output rows (units grow by the factor, as
    nearest upsampling's), which also read the rows around them: ``collective_kernels`` makes it
    ``collectives.halo_interpolation`` (``exchange``: on a sequence axis). Aligned corners or a size given
    instead of a factor place source positions by the whole image's size: refused."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement) or placement.dim < 2:
        return decision
    rows, out = shape_of(source)[placement.dim], shape_of(node)[placement.dim]
    align_corners, scales = node.args[2], node.args[3] if len(node.args) > 3 else None
    factor = scales[placement.dim - (len(shape_of(source)) - len(scales))] if scales is not None else None
    if not exchange or align_corners or factor is None or factor != int(factor) or out != rows * factor \
            or isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        raise Unshardable(f"{node.target.__name__} of the sharded dim {placement.dim} ({rows} to {out} rows, "
                          f"align_corners={align_corners}, scale {factor}): its source rows would be placed by the "
                          "whole image")
    reach = INTERPOLATING[node.target][1]
    if min(shard_widths(placement, rows, axis_size)) < reach:
        raise Unshardable(f"{node.target.__name__}: a rank holds fewer than the {reach} rows its neighbour reads")
    return Decision(packed_shard(placement.dim, (out,), unit_of(placement) * int(factor), axis_size),
                    decision.inputs)


for _op in INTERPOLATING:
    register(_op)(lambda node, placements, axis_size: interpolating_upsampling(node, placements, axis_size, False))
    register_factory(_op, axis="sequence")(
        lambda roles, axis=None: lambda node, placements, axis_size: interpolating_upsampling(
            node, placements, axis_size, exchange=axis in SEQUENCE_AXES))


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle(node: Node, placements, axis_size: int) -> Decision:
    """Depth-to-space (``pixel_shuffle``: ``[N, C r^2, H, W] -> [N, C, H r, W r]``) moves channels into each input
    row's own ``r`` output rows: a shard of H in units of ``u`` becomes one in units of ``u r``; space-to-depth
    (``pixel_unshuffle``) gathers each ``r`` rows into one, so every rank's rows must start at a multiple of ``r``
    (a shard in units of ``u``, ``u`` a multiple of ``r``, becomes one in units of ``u / r``). The batch passes;
    split channels would be regrouped."""
    source = node.args[0]
    placement = placements.get(source, R)
    decision = same_as_input(node, placements, source)
    if not is_sharded(placement) or placement.dim < len(shape_of(source)) - 3:
        return decision
    if placement.dim == len(shape_of(source)) - 3:
        raise Unshardable(f"{node.target.__name__} regroups the sharded channels")
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        raise Unshardable(f"{node.target.__name__} of a spatial dim packed from several parts")
    rows, out, factor = shape_of(source)[placement.dim], shape_of(node)[placement.dim], node.args[1]
    unit = boundary_unit(placement, rows, axis_size)
    if node.target is aten.pixel_shuffle.default:
        return Decision(packed_shard(placement.dim, (out,), unit * factor, axis_size), decision.inputs)
    if unit % factor:
        raise NeedsUnit(source, factor)  # every rank's rows must start at a multiple of the factor
    return Decision(packed_shard(placement.dim, (out,), unit // factor, axis_size), decision.inputs)
