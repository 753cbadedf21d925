"""Convolutions (the 1x1 ones are Linears by then: ``passes/pointwise_convs``). A convolution mixes its spatial
dims through its kernel and, inside each group, its channels:
- a sharded batch passes through (every sample is convolved alone);
- over a sequence axis (ring, ulysses), rows of a spatial dim split in order (evenly or not: a VAE's odd latent
  height) pass through any convolution whose every rank computes the output rows of its own rows (``split_rows``:
  same-size, strided when every rank starts at a multiple of the stride, transposed): ``collective_kernels`` makes
  it a ``collectives.halo_convolution`` (or ``halo_transposed_convolution``), each rank borrowing the rows its
  kernel reaches from its two neighbours (Sana's 3x3 depthwise convolution over an image whose rows Ulysses
  splits; a VAE's decoder and encoder);
- sharded channels pass through a grouped convolution that keeps its channel count (depthwise: Sana's 3x3 between
  its two pointwise convolutions) when every rank's channels are whole groups; its weight and bias are cut alike and
  ``localize`` gives each rank its own number of groups;
- any other sharded spatial dim, or channels a group-1 convolution mixes, is Unshardable.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..mesh import SEQUENCE_AXES
from ..placement import PackedShard, Partial, boundary_unit, is_sharded, packed_shard, shard_slices, shard_widths
from ..runtime import collectives
from .core import Decision, NeedsUnit, R, Unshardable, register, register_factory, shape_of, with_dim

aten = torch.ops.aten
_TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
          collectives.padded_convolution, *_TRANSPOSED)
# where each convolution op takes its number of groups
GROUPS_ARGUMENT = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.conv3d.default: 6,
                   aten.convolution.default: 8, collectives.halo_convolution: 6, collectives.padded_convolution: 6,
                   **{op: 6 for op in _TRANSPOSED}, collectives.halo_transposed_convolution: 6}


def conv_arguments(node: Node) -> tuple[list[int], list[int], list[int], bool]:
    """stride, padding, dilation (one per spatial dim) and whether it is transposed. A ``padded_convolution``'s
    padding differs on its two sides: see ``padding_pairs``; here each dim's padding before its rows."""
    spatial = len(shape_of(node.args[0])) - 2
    if node.target is collectives.padded_convolution:
        stride, padding, dilation = node.args[3:6]
        return _per_dim(stride, spatial), [before for before, _ in padding], _per_dim(dilation, spatial), False
    if node.target is aten.convolution.default:
        stride, padding, dilation, transposed = node.args[3:7]
    elif node.target in _TRANSPOSED:  # (input, weight, bias, stride, padding, output_padding, groups, dilation)
        stride, padding, dilation = [(node.args[i] if len(node.args) > i else default)
                                     for i, default in ((3, 1), (4, 0), (7, 1))]
        transposed = True
    else:
        stride, padding, dilation = (*node.args[3:6], *(1, 0, 1)[len(node.args[3:6]):])
        transposed = False
    return _per_dim(stride, spatial), _per_dim(padding, spatial), _per_dim(dilation, spatial), transposed


def output_padding_of(node: Node) -> list[int]:
    """A transposed convolution's extra output rows at the end of each spatial dim."""
    spatial = len(shape_of(node.args[0])) - 2
    index = 7 if node.target is aten.convolution.default else 5
    return _per_dim(node.args[index] if len(node.args) > index else 0, spatial)


def pad_mode(node: Node) -> str:
    """How a convolution's padding is filled: "constant" (zeros), or a ``padded_convolution``'s "replicate" or
    "reflect"."""
    if node.target is collectives.padded_convolution and len(node.args) > 7:
        return node.args[7]
    return "constant"


def padding_pairs(node: Node) -> list[list[int]]:
    """``[before, after]`` zero padding of each spatial dim."""
    if node.target is collectives.padded_convolution:
        return [list(pair) for pair in node.args[4]]
    return [[p, p] for p in conv_arguments(node)[1]]


def _per_dim(value, spatial: int) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * spatial if len(values) == 1 else values


def groups_of(node: Node) -> int:
    index = GROUPS_ARGUMENT[node.target]
    return node.args[index] if len(node.args) > index else node.kwargs.get("groups", 1)


@register(*_CONVS)
def convolution(node: Node, placements, axis_size: int, halo: bool = False) -> Decision:
    x, weight = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    px = placements.get(x, R)
    px = R if isinstance(px, Partial) else px
    inputs = {n: R for n in node.all_input_nodes}
    inputs[x] = px
    if not is_sharded(px):
        return Decision(R, inputs)
    if len(shape_of(x)) != len(shape_of(weight)):
        raise Unshardable("an unbatched convolution with a sharded input")
    if px.dim == 0:
        return Decision(px, inputs)
    if px.dim != 1:
        if halo:
            return Decision(split_rows(node, px, axis_size), inputs)
        raise Unshardable(f"convolution over the sharded spatial dim {px.dim}")
    if conv_arguments(node)[3]:
        raise Unshardable("a transposed convolution with sharded channels")
    channels, groups = shape_of(x)[1], groups_of(node)
    if groups == 1 or shape_of(weight)[0] != channels:
        raise Unshardable(f"a convolution of {groups} group(s) mixes the sharded channels "
                          f"({channels} in, {shape_of(weight)[0]} out)")
    per_group = channels // groups
    ranges = [shard_slices(px, channels, axis_size, rank) for rank in range(axis_size)]
    if any(start % per_group or end % per_group for rank in ranges for start, end in rank):
        raise NeedsUnit(x, per_group)
    if any(sum(end - start for start, end in rank) == 0 for rank in ranges):
        raise Unshardable(f"a convolution of {groups} groups leaves a rank no channels")
    inputs[weight] = with_dim(px, 0)
    if bias is not None:
        inputs[bias] = with_dim(px, 0)
    return Decision(px, inputs)


def split_rows(node: Node, placement, axis_size: int):
    """The output placement of a convolution over rows of one spatial dim split in order (evenly or not, in any
    unit): each rank computes the output rows of its own rows, ``rows / stride`` of them, borrowing from its
    neighbours the rows its kernel reaches past its own (``halo_rows``; the padding at the image's edges only). A
    strided convolution needs every rank's first row at a multiple of the stride (``NeedsUnit``)."""
    x, dim = node.args[0], placement.dim
    size, out, spatial = shape_of(x)[dim], shape_of(node)[dim], dim - 2
    strides, _, _, transposed = conv_arguments(node)
    stride = strides[spatial]
    if isinstance(placement, PackedShard) and len(placement.blocks) > 1:
        raise Unshardable(f"convolution over the sharded spatial dim {dim} packed from several parts")
    if transposed:
        return _split_rows_transposed(node, placement, axis_size)
    if out * stride != size:
        raise Unshardable(f"convolution over the sharded spatial dim {dim} maps {size} rows to {out} (stride "
                          f"{stride}, padding {padding_pairs(node)[spatial]}): not each rank's rows / stride")
    before, after = halo_rows(node, dim)
    if after < 0:
        raise Unshardable(f"a convolution of stride {stride} reading fewer rows than it steps over along dim {dim}")
    ranges = [shard_slices(placement, size, axis_size, rank)[0] for rank in range(axis_size)]
    if any(start % stride for start, _ in ranges):
        raise NeedsUnit(x, stride)
    widths = [end - start for start, end in ranges]
    _every_rank_holds_rows(dim, size, widths)
    mirrored = pad_mode(node) == "reflect"  # the first and last rank mirror rows next to their edge row
    if min(widths) < max(before, after) or mirrored and min(widths[0], widths[-1]) <= max(before, after):
        raise Unshardable(f"convolution over the sharded spatial dim {dim}: {size} rows split {widths} over "
                          f"{axis_size} ranks, fewer on some rank than the {max(before, after)} its neighbour "
                          "borrows" + (" or its own edge mirrors" if mirrored else ""))
    if stride == 1:
        return placement
    unit = boundary_unit(placement, size, axis_size)
    if unit % stride:
        raise NeedsUnit(x, stride)
    result = packed_shard(dim, (out,), unit // stride, axis_size)
    if shard_widths(result, out, axis_size) != [w // stride for w in widths]:
        raise Unshardable(f"strided convolution over the sharded spatial dim {dim}: rows {widths} do not map to "
                          f"whole output rows per rank")
    return result


def _split_rows_transposed(node: Node, placement, axis_size: int):
    """A transposed convolution (upsampling by its stride) over split input rows: each rank computes the
    ``rows * stride`` output rows of its own rows, from its rows and those its neighbours lend (``halo_rows``)."""
    dim = placement.dim
    size, out, spatial = shape_of(node.args[0])[dim], shape_of(node)[dim], dim - 2
    stride, padding, dilation, _ = conv_arguments(node)
    before, after = halo_rows(node, dim)
    reach = dilation[spatial] * (shape_of(node.args[1])[dim] - 1)
    if out != size * stride[spatial] or before < 0 or padding[spatial] > (after - 1) * stride[spatial] + reach + 1:
        raise Unshardable(f"transposed convolution over the sharded spatial dim {dim} maps {size} rows to {out} "
                          f"(stride {stride[spatial]}, padding {padding[spatial]}): not each rank's rows x stride")
    widths = shard_widths(placement, size, axis_size)
    _every_rank_holds_rows(dim, size, widths)
    if min(widths) < max(before, after):
        raise Unshardable(f"transposed convolution over the sharded spatial dim {dim}: {size} rows split {widths}, "
                          f"fewer on some rank than the {max(before, after)} its neighbour borrows")
    return packed_shard(dim, (out,), boundary_unit(placement, size, axis_size) * stride[spatial], axis_size)


def _every_rank_holds_rows(dim: int, size: int, widths: list[int]) -> None:
    """A convolution cannot run on no rows (PyTorch refuses an input smaller than its kernel, even 1 x 1): fewer
    rows than ranks stay whole here, and a later convolution over more rows splits them again."""
    if min(widths) == 0:
        raise Unshardable(f"convolution over the sharded spatial dim {dim}: {size} rows split {widths} over "
                          f"{len(widths)} ranks, none on some rank")


def halo_rows(node: Node, dim: int) -> tuple[int, int]:
    """(rows before, rows after) a rank's own rows along ``dim`` that its output rows read: the padding before
    them, and what the kernel reaches past the last stride step."""
    spatial = dim - 2
    stride, _, dilation, transposed = conv_arguments(node)
    before = padding_pairs(node)[spatial][0]
    reach = dilation[spatial] * (shape_of(node.args[1])[dim] - 1)
    if transposed:  # input rows whose kernels reach this rank's first output row, and its last
        step = stride[spatial]
        return (reach - before) // step, (step - 1 + before) // step
    return before, reach + 1 - stride[spatial] - before


@register_factory(aten.conv1d.default, axis="sequence")
@register_factory(aten.conv2d.default, axis="sequence")
@register_factory(aten.conv3d.default, axis="sequence")
@register_factory(aten.convolution.default, axis="sequence")
@register_factory(collectives.padded_convolution, axis="sequence")
@register_factory(aten.conv_transpose1d.default, axis="sequence")
@register_factory(aten.conv_transpose2d.input, axis="sequence")
@register_factory(aten.conv_transpose3d.input, axis="sequence")
def make_sequence_convolution(roles, axis: str | None = None):
    """Over ring and ulysses a convolution borrows its neighbours' rows; over other axes that use the sequence
    rules (tp's rows between its regions, a batch axis, bucket padding) a sharded spatial dim is Unshardable."""
    del roles
    return lambda node, placements, axis_size: convolution(node, placements, axis_size,
                                                           halo=axis in SEQUENCE_AXES)
