"""XLA SPMD (torch_xla): the plan's placements become sharding annotations; XLA's SPMD partitioner inserts the
collectives, and its partitioned HLO is checked against the plan.

One process drives every XLA device, so this backend takes the *global* planned graph (``Partitioned.planned_graph``,
before ``insert_collectives``) and the model's full tensors. It interprets the graph on XLA tensors and annotates:

- every input with ``mark_sharding`` from its placements (``Shard(d)`` over an axis puts that mesh axis on dim
  ``d``; a dim sharded over several axes lists them in mesh order, as ``localize`` splits them);
- every value whose placements XLA can express (no ``Partial``) with a custom sharding annotation, so XLA's
  propagation has no freedom to pick another layout;
- every edge where a consumer requires another placement than its producer has (the edges where
  ``insert_collectives`` puts a collective) with a second annotation on a copy: Shard(a) -> Shard(b) becomes XLA's
  all-to-all, Partial -> Replicate its all-reduce, Shard -> Replicate its all-gather, Replicate -> Shard a local
  slice.

Two layouts differ from the plan's global one, where XLA's equal tiles cannot express what a rank holds:

- packed values (a ``PackedShard``: SwiGLU's ``[value; gate]`` in one Linear, Flux's ``cat([attention, mlp])``
  before a row-wise Linear): each rank holds a slice of every block, not one contiguous range. Annotated naively,
  XLA re-lays the blocks out with collective-permutes. They are held rank-major instead (``Packed``);
- a dim split over tp and then unevenly over ulysses (3 heads per tp rank, 2 + 1): each tp shard is padded to a
  multiple of the ulysses degree around the exchange (``Nested``).

Three ops are written out so that XLA keeps their operands sharded: Linear and attention as einsums
(``aten.linear`` and ``scaled_dot_product_attention`` flatten batch dims into one, merging a sharded dim with an
unsharded one), and layer_norm as reductions over its dims (torch_xla lowers it to batch-norm over the rows).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx import GraphModule, Interpreter, Node

from ..errors import BackendError
from ..mesh import MeshSpec
from ..placement import PackedShard, Partial, Replicate, Shard
from ..runtime import place_graph_on
from ..trace import copy_graph_module

aten = torch.ops.aten
_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}


class XlaBackendError(BackendError):
    pass


class CollectiveMismatch(BackendError, AssertionError):
    pass


def _torch_xla():
    try:
        import torch_xla  # noqa: F401
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as error:
        raise XlaBackendError(
            f"backend='xla' needs torch_xla, which is not importable here ({error}). torch_xla 2.9 needs exactly "
            f"torch==2.9.0 (this is torch {torch.__version__}): use a separate virtual environment, e.g. "
            "`make test` creates .venv-xla (see README, XLA SPMD)") from error
    return torch_xla, xs, xr


# ----------------------------------------------------------------------------------------------------------------
# Placements -> partition specs


def partition_spec(placements: dict, ndim: int, mesh_axes: tuple[str, ...]) -> tuple | None:
    """The torch_xla partition spec of a value placed as ``placements`` (axis -> placement), or None when XLA
    cannot express it (Partial, or a packed shard of the fused dim)."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis in mesh_axes:
        placement = placements.get(axis, Replicate())
        if isinstance(placement, (Partial, PackedShard, tuple)):
            return None
        if isinstance(placement, Shard):
            dims[placement.dim % ndim].append(axis)
    return tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims)


def packed_spec(placements: dict, ndim: int, mesh_axes: tuple[str, ...]) -> tuple | None:
    """The spec of a packed value in its rank-major layout (one more dim than the value, see ``Packed``): the
    packed axis shards the new rank dim, the other axes keep their dims (shifted past it)."""
    fused = _packed_placement(placements).dim % ndim
    moved = {}
    for axis, placement in placements.items():
        if isinstance(placement, PackedShard):
            moved[axis] = Shard(fused)
        elif isinstance(placement, Shard) and placement.dim % ndim > fused:
            moved[axis] = Shard(placement.dim % ndim + 1)
        else:
            moved[axis] = placement
    return partition_spec(moved, ndim + 1, mesh_axes)


@dataclass
class Packed:
    """A value of a ``PackedShard`` placement in its rank-major layout: the packed dim ``dim`` of global size
    ``sum(blocks)`` is held as ``[ranks, sum(blocks) // ranks]``, rank ``r`` holding its slice of every block, in
    block order. Sharded on the rank dim, this is exactly what each rank holds, so XLA needs no data movement for a
    Linear that makes it or consumes it (one contraction, one all-reduce), nor for splitting it into blocks."""
    tensor: torch.Tensor
    dim: int
    blocks: tuple[int, ...]

    @staticmethod
    def from_blocks(tensors, dim: int, ranks: int) -> "Packed":
        pieces = [t.unflatten(dim, (ranks, t.shape[dim] // ranks)) for t in tensors]
        return Packed(torch.cat(pieces, dim + 1), dim, tuple(t.shape[dim] for t in tensors))

    @property
    def ranks(self) -> int:
        return self.tensor.shape[self.dim]

    def split(self) -> tuple[torch.Tensor, ...]:
        """The blocks, each sharded on ``dim``: a slice of the unsharded dim, then a merge of the rank dim."""
        pieces = self.tensor.split([size // self.ranks for size in self.blocks], self.dim + 1)
        return tuple(piece.flatten(self.dim, self.dim + 1) for piece in pieces)

    def fused(self) -> torch.Tensor:
        """The value in its global layout (XLA moves data to build it: only where the plan has no packed rule)."""
        return torch.cat(self.split(), self.dim)


def _packed_placement(placements: dict) -> PackedShard | None:
    packed = [p for p in placements.values() if isinstance(p, PackedShard)]
    if len(packed) > 1:
        raise XlaBackendError(f"a value packed over several mesh axes ({placements}) is not supported")
    return packed[0] if packed else None


def _packed_ranks(placements: dict, mesh) -> int:
    """How many ranks the packed axis has: the rank dim of the layout."""
    return next(mesh.size(axis) for axis, p in placements.items() if isinstance(p, PackedShard))


@dataclass
class Nested:
    """A value whose dim ``dim`` the plan shards over two axes, ``outer`` shards first, each then split over the
    inner axis unevenly (tiny H3 at TP=2 x Ulysses=2 with 6 heads: 3 per tp rank, 2 + 1 over ulysses; H3 at TP=8 x
    Ulysses=8: 7 over 8). XLA tiles a dim in equal tiles, so no sharding of the dim keeps the tp shards whole. Each
    outer shard is padded with zeros to a multiple of the inner degree instead: equal tiles then fall exactly as the
    plan splits. Attention runs on the padded heads (zeros in, zeros out), and the pad is dropped once the inner
    axis no longer shards the dim."""
    tensor: torch.Tensor
    dim: int
    outer: int
    local: int  # real entries per outer shard

    @staticmethod
    def pad(tensor: torch.Tensor, dim: int, outer: int, inner: int) -> "Nested":
        local = tensor.shape[dim] // outer
        blocks = tensor.unflatten(dim, (outer, local))
        shape = list(blocks.shape)
        shape[dim + 1] = -local % inner
        padded = torch.cat([blocks, blocks.new_zeros(shape)], dim + 1)
        return Nested(padded.flatten(dim, dim + 1), dim, outer, local)

    def unpad(self) -> torch.Tensor:
        blocks = self.tensor.unflatten(self.dim, (self.outer, -1))
        return blocks.narrow(self.dim + 1, 0, self.local).flatten(self.dim, self.dim + 1)


def nested_uneven(placements: dict, shape, mesh) -> tuple[int, int, int] | None:
    """(dim, outer size, inner size) where ``placements`` shard a dim over two axes and the outer shards do not
    split evenly over the inner axis; None if there is no such dim."""
    for dim, size in enumerate(shape):
        axes = [axis for axis in mesh.axis_names
                if isinstance(placements.get(axis), Shard) and placements[axis].dim % len(shape) == dim]
        if len(axes) == 2:
            outer, inner = mesh.size(axes[0]), mesh.size(axes[1])
            if size % outer == 0 and size // outer % inner:
                return dim, outer, inner
    return None


def _fused(value):
    if isinstance(value, Packed):
        return value.fused()
    return value.unpad() if isinstance(value, Nested) else value


# ----------------------------------------------------------------------------------------------------------------
# Running the annotated global graph


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


def _annotate(value, placements: dict, xs, xla_mesh, mesh_axes, *, mark: bool = False):
    """Annotate ``value`` (returned) with ``placements`` where XLA can express them: ``mark_sharding`` for data put
    on the device, a custom sharding annotation for values computed in the graph."""
    if isinstance(value, Packed):
        tensor, spec = value.tensor, packed_spec(placements, value.tensor.dim() - 1, mesh_axes)
    elif isinstance(value, Nested):
        tensor, spec = value.tensor, partition_spec(placements, value.tensor.dim(), mesh_axes)
    elif isinstance(value, torch.Tensor) and value.dim():
        tensor, spec = value, partition_spec(placements, value.dim(), mesh_axes)
    else:
        return value
    if spec is not None:
        (xs.mark_sharding if mark else xs.annotate_custom_sharding)(tensor, xla_mesh, spec)
    return value


class _Annotator(Interpreter):
    """Runs the planned graph on XLA tensors, annotating every value and every redistributed edge."""

    def __init__(self, gm: GraphModule, xs, xla_mesh, mesh):
        super().__init__(gm)
        self.xs, self.xla_mesh, self.mesh, self.mesh_axes = xs, xla_mesh, mesh, mesh.axis_names
        self.copies: dict[tuple[Node, tuple], object] = {}  # (producer, required placements) -> annotated copy

    def _annotate(self, value, placements: dict):
        return _annotate(value, placements, self.xs, self.xla_mesh, self.mesh_axes)

    def _as_required(self, producer: Node, consumer: Node):
        """``producer``'s value as ``consumer`` requires it: a copy annotated with the required placement where it
        differs (the edge where insert_collectives would put a collective)."""
        value = self.env[producer]
        current = producer.meta.get("placements", {})
        required = dict(current)
        for axis, requirements in consumer.meta.get("required", {}).items():
            required[axis] = requirements.get(producer, required.get(axis))
        if required == current or any(isinstance(p, tuple) for p in required.values()):
            return value
        key = (producer, tuple(sorted((axis, repr(p)) for axis, p in required.items())))
        if key not in self.copies:
            self.copies[key] = self._redistributed(producer, value, current, required)
        return self.copies[key]

    def _redistributed(self, producer: Node, value, current: dict, required: dict):
        """A copy of ``value`` annotated as ``required``. Into or out of a nested uneven placement, the exchange
        happens on the padded value (see ``Nested``), so that XLA sees equal tiles on both sides."""
        if isinstance(value, Packed):
            raise XlaBackendError(f"{producer.name}: redistributing a packed value is not supported")
        if not isinstance(value, (torch.Tensor, Nested)):
            return value
        shape = value.tensor.shape if isinstance(value, Nested) else value.shape
        nested = nested_uneven(required, shape, self.mesh) if isinstance(value, torch.Tensor) else None
        if nested is not None:  # pad where the value is, exchange the padded value
            value = self._annotate(Nested.pad(value, *nested), current)
        if isinstance(value, Nested):
            exchanged = self._annotate(Nested(value.tensor.clone(), value.dim, value.outer, value.local), required)
            real = list(shape)
            real[value.dim] = value.outer * value.local
            if nested_uneven(required, real, self.mesh) is not None:  # still nested: stay padded
                return exchanged
            return self._annotate(exchanged.unpad(), required)  # the inner axis left: drop the pad, locally
        return self._annotate(value.clone(), required)

    def run_node(self, node: Node):
        if node.op == "placeholder":
            return next(self.args_iter)  # on the device and marked already (XlaProgram._on_device)
        if node.op != "call_function":
            return super().run_node(node)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda p: self._as_required(p, node))
        value = self._call(node, args, kwargs)
        return self._annotate(value, node.meta.get("placements", {}))

    def _call(self, node: Node, args, kwargs):
        target = node.target
        placements = node.meta.get("placements", {})
        if target is aten.cat.default and _packed_placement(placements) is not None:
            packed = _cat_as_packed(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0),
                                    _packed_placement(placements), _packed_ranks(placements, self.mesh))
            if packed is not None:
                return packed
        if target is aten.linear.default:
            return _linear(*args, **kwargs)
        if target is aten.scaled_dot_product_attention.default:
            nested = [a for a in args[:3] if isinstance(a, Nested)]
            if len(nested) == 3 and len({(n.dim, n.outer, n.local, n.tensor.shape[n.dim]) for n in nested}) == 1:
                out = _attention(*(n.tensor for n in nested), *args[3:], **kwargs)  # padded heads: zeros
                return Nested(out, nested[0].dim, nested[0].outer, nested[0].local)
            args = tuple(_fused(a) for a in args)
            return _attention(*args, **kwargs)
        if target is aten.layer_norm.default:
            return _layer_norm(*args, **kwargs)
        if target in _SPLITS and isinstance(args[0], Packed):
            pieces = _split_packed(target, args[0], args, kwargs)
            if pieces is not None:
                return pieces
        packed = _pointwise_packed(target, args, kwargs)
        if packed is not None:
            return packed
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), _fused)
        return target(*args, **kwargs)

    def output(self, target, args, kwargs):
        return torch.fx.node.map_aggregate(args[0], _fused)


# ----------------------------------------------------------------------------------------------------------------
# Reading the partitioned HLO

_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.*?)\s(all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}")


@dataclass(frozen=True)
class HloCollective:
    name: str  # the HLO instruction
    kind: str  # all_reduce, all_gather, all_to_all, collective_permute, reduce_scatter
    groups: tuple[tuple[int, ...], ...]  # replica groups (collective_permute: source-target pairs)
    shape: str  # of its result, as HLO writes it


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    if match := _IOTA_GROUPS.search(line):
        count, size, dims, perm = match.groups()
        ids = torch.arange(math.prod(map(int, dims.split(",")))).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.permute([int(p) for p in perm.split(",")])
        return tuple(map(tuple, ids.reshape(int(count), int(size)).tolist()))
    match = _LIST_GROUPS.search(line) or _PAIRS.search(line)
    if not match:
        return ()
    return tuple(tuple(int(x) for x in group.split(",") if x) for group in re.findall(r"\{([\d,]*)\}", match.group(1)))


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective of an HLO module's text, with its replica groups."""
    found = []
    for line in hlo_text.splitlines():
        if match := _COLLECTIVE.match(line):
            name, shape, kind = match.groups()
            found.append(HloCollective(name, kind.replace("-", "_"), _groups(line), shape))
    return found


def axis_of(groups, mesh) -> str:
    """The mesh axis whose process groups are ``groups``, else a description of the groups. No groups (HLO's
    ``replica_groups={}``) means all devices."""
    normalized = sorted(sorted(group) for group in groups) or [list(range(mesh.world_size))]
    for axis in mesh.axis_names:
        if sorted(mesh.groups(axis)) == normalized:
            return axis
    if normalized == [list(range(mesh.world_size))]:
        return "all"
    return f"groups {normalized}"


def compare(found: list[HloCollective], planned: Counter, mesh) -> list[str]:
    """Differences between XLA's collectives and the plan's ((kind, axis) -> count), as readable lines."""
    got = Counter((c.kind, "pairs" if c.kind == "collective_permute" else axis_of(c.groups, mesh)) for c in found)
    problems = []
    for key in sorted(set(got) | set(planned)):
        if got[key] == planned[key]:
            continue
        kind, axis = key
        line = f"{kind} over {axis}: XLA has {got[key]}, the plan {planned[key]}"
        if got[key] > planned[key]:
            extra = [c for c in found if c.kind == kind and (kind == "collective_permute"
                                                             or axis_of(c.groups, mesh) == axis)]
            line += "; XLA's: " + ", ".join(f"{c.name} {c.shape} {[list(g) for g in c.groups]}" for c in extra[:8])
        problems.append(line)
    return problems


# ----------------------------------------------------------------------------------------------------------------
# The backend


_OWN_DUMPS = "partitioner-xla-"  # prefix of the dump folder this backend makes when XLA_FLAGS names none


def _dump_dir() -> Path | None:
    match = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return Path(match.group(1)) if match else None


def _prepare_runtime(torch_xla, xr, mesh, verify) -> MeshSpec:
    """SPMD mode and (to verify) HLO dumps: XLA reads its flags once, when its runtime starts. Returns the mesh over
    all of XLA's devices: the plan's, behind a leading ``replicas`` axis over which everything is replicated when
    XLA has more devices than the plan (every group of consecutive devices runs the plan)."""
    started = torch_xla._XLAC._xla_runtime_is_initialized()
    if verify and _dump_dir() is None:
        if started:
            raise XlaBackendError("verify=True reads XLA's partitioned HLO, but the XLA runtime started without "
                                  "--xla_dump_to: set XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text' before "
                                  "the first XLA call, or compile with verify=False")
        flags = f"--xla_dump_to={tempfile.mkdtemp(prefix=_OWN_DUMPS)} --xla_dump_hlo_as_text"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    if not xr.is_spmd():
        xr.use_spmd()
    devices = xr.global_runtime_device_count()
    if devices % mesh.world_size:
        raise XlaBackendError(f"the mesh {mesh.sizes} has {mesh.world_size} devices, which do not divide XLA's "
                              f"{devices}; on CPU start with PJRT_DEVICE=CPU CPU_NUM_DEVICES={mesh.world_size}")
    if devices == mesh.world_size:
        return mesh
    return MeshSpec(("replicas",) + mesh.axis_names, (devices // mesh.world_size,) + mesh.axis_sizes, 0, None)


# XLA compiles a graph once per process and dumps it then: what its partitioned HLO held, by XLA's graph hash.
_PARTITIONED: dict[object, tuple[list[str], list[HloCollective]]] = {}


@dataclass
class XlaStats:
    collectives: list[HloCollective] = field(default_factory=list)  # in XLA's partitioned HLO (first call)
    mismatches: list[str] = field(default_factory=list)
    hlo_files: list[str] = field(default_factory=list)


class XlaProgram:
    """Takes the global graph's inputs as CPU tensors, returns its outputs as CPU tensors."""

    def __init__(self, planned: GraphModule, mesh, planned_collectives: Counter, verify):
        self.torch_xla, self.xs, self.xr = _torch_xla()
        mesh = _prepare_runtime(self.torch_xla, self.xr, mesh, verify)
        self.device = self.torch_xla.device()
        # device i of the mesh is XLA device i, so HLO replica groups read as mesh.groups(axis)
        self.xla_mesh = self.xs.Mesh(list(range(mesh.world_size)), mesh.axis_sizes, mesh.axis_names)
        self.gm = copy_graph_module(planned)
        place_graph_on(self.gm, self.device)
        self.mesh, self.planned_collectives, self.verify = mesh, planned_collectives, verify
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.stats = XlaStats()
        self.calls = 0
        self.placed: dict[int, tuple] = {}  # input index -> ((id, version) of the host tensor, device value, it)

    def _on_device(self, index: int, value, node: Node):
        """Input ``index`` on the XLA devices, sharded as its placements say. A tensor passed again unchanged (a
        weight: the same object, the same version) is reused, so weights move and are laid out once."""
        if not isinstance(value, torch.Tensor):
            return value
        key = (id(value), value._version)
        if self.placed.get(index, (None,))[0] == key:
            return self.placed[index][1]
        placements = node.meta.get("placements", {})
        packed = _packed_placement(placements)
        if packed is not None:  # laid out rank-major on the host, so the device never holds the fused layout
            dim, ranks = packed.dim % value.dim(), _packed_ranks(placements, self.mesh)
            host = Packed.from_blocks(value.split(list(packed.blocks), dim), dim, ranks)
            placed = Packed(host.tensor.to(self.device), dim, host.blocks)
        else:
            placed = value.to(self.device)
        placed = _annotate(placed, placements, self.xs, self.xla_mesh, self.mesh.axis_names, mark=True)
        self.placed[index] = (key, placed, value)  # holding value keeps its id from being reused
        return placed

    def __call__(self, *inputs):
        if len(inputs) != len(self.placeholders):
            raise XlaBackendError(f"expected {len(self.placeholders)} inputs, got {len(inputs)}")
        before = self._dumped() if self._verifying() else set()
        args = [self._on_device(i, value, node) for i, (value, node) in enumerate(zip(inputs, self.placeholders))]
        annotator = _Annotator(self.gm, self.xs, self.xla_mesh, self.mesh)
        with torch.no_grad():  # an inference graph: no autograd record on the XLA tensors
            outputs = annotator.run(*args)
        del annotator, args
        tensors = [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        graph_hash = self.torch_xla._XLAC._get_graph_hash(tensors) if self._verifying() else None
        self.torch_xla.sync()
        result = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, outputs)
        if self._verifying():
            new = self._dumped() - before
            try:
                self._verify(graph_hash, sorted(f for f in new if f.endswith("after_optimizations.txt")))
            finally:
                if _dump_dir().name.startswith(_OWN_DUMPS):  # ours: keep the HLO, not every kernel's IR (MBs)
                    for f in new:
                        if not f.endswith("optimizations.txt"):
                            Path(f).unlink(missing_ok=True)
        self.calls += 1
        return result

    def _verifying(self) -> bool:
        return bool(self.verify) and self.calls == 0

    def _dumped(self) -> set[str]:
        return {str(p) for p in _dump_dir().iterdir()}

    def _verify(self, graph_hash, files: list[str]) -> None:
        if files:
            _PARTITIONED[graph_hash] = (files, [c for f in files for c in hlo_collectives(Path(f).read_text())])
        elif graph_hash not in _PARTITIONED:
            raise XlaBackendError(
                f"XLA compiled nothing new and dumped no partitioned HLO to {_dump_dir()}: it reused this graph, "
                "compiled earlier in this process without verify (or its runtime started before --xla_dump_to was "
                "set, or dumps only protos). Verify in a fresh process, or compile with verify=False")
        self.stats.hlo_files, self.stats.collectives = _PARTITIONED[graph_hash]
        self.stats.mismatches = compare(self.stats.collectives, self.planned_collectives, self.mesh)
        if self.stats.mismatches:
            message = ("XLA's partitioned HLO does not have the plan's collectives:\n  "
                       + "\n  ".join(self.stats.mismatches) + f"\n(HLO: {self.stats.hlo_files[-1]})")
            if self.verify == "warn":
                warnings.warn(message)
            else:
                raise CollectiveMismatch(message)


def lower(planned: GraphModule, *, mesh, planned_collectives: Counter | None = None, verify: bool | str = True):
    """``planned``: the global graph with placements. ``verify``: True checks the first call's partitioned HLO
    against ``planned_collectives`` ((kind, axis) -> count) and raises ``CollectiveMismatch``; "warn" warns; False
    skips reading the HLO."""
    if verify and planned_collectives is None:
        raise ValueError("verify needs the plan's collectives")
    return XlaProgram(planned, mesh, planned_collectives or Counter(), verify)
