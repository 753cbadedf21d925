"""What a partition costs one rank: parameter bytes, how much of it is replicated, and every collective."""

from __future__ import annotations

import operator
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch.fx import GraphModule

from ..decisions import Hoisted, HostKind
from ..mesh import SEQUENCE_AXES
from ..passes.context import PassContext
from ..placement import is_sharded, local_shape
from ..annotations import annotation


@dataclass(frozen=True)
class CollectiveStat:
    kind: str
    axis: str
    count: int
    bytes_per_call: int  # bytes of the collective's result on one rank


@dataclass
class Report:
    mesh: str
    parameters: int  # parameter elements held by this rank
    parameter_bytes: dict[str, int]  # dtype -> bytes held by this rank
    replicated_bytes: int  # of which held whole by every rank
    buffer_bytes: int
    collectives: list[CollectiveStat]
    activation_peak_bytes: int  # estimate: most bytes of intermediate values alive at once, run in graph order
    linear_styles: dict[str, str] = field(default_factory=dict)
    hoisted: dict[str, Hoisted] = field(default_factory=dict)  # node -> why it runs in the host prologue
    specializations: dict[str, str] = field(default_factory=dict)  # call shapes served by another trace -> why
    buckets: dict[str, str] = field(default_factory=dict)  # "input dim d" -> its buckets and the ops reading it
    # every rank's parameter elements and bytes, in rank order (uneven splits give ranks different shares)
    rank_parameters: list[tuple[int, int]] = field(default_factory=list)
    # attentions sequence-sharded over every sequence axis, of all (None without a sequence axis), and why not
    attentions_sharded: tuple[int, int] | None = None
    attentions_whole: dict[str, str] = field(default_factory=dict)

    @property
    def total_parameter_bytes(self) -> int:
        return sum(self.parameter_bytes.values())

    @property
    def replicated_share(self) -> float:
        return self.replicated_bytes / self.total_parameter_bytes if self.total_parameter_bytes else 0.0

    def parameter_extremes(self) -> dict[str, dict[str, int]]:
        """The ranks holding the most and the fewest parameter bytes: {"largest": {rank, parameter_count, bytes},
        "smallest": ...}."""
        return parameter_extremes(self.rank_parameters)

    def count(self, kind: str) -> int:
        return sum(c.count for c in self.collectives if c.kind == kind)

    def __str__(self) -> str:
        lines = [f"partition report: {self.mesh}",
                 f"  parameters per rank: {self.parameters:,} ({human_bytes(self.total_parameter_bytes)}), "
                 f"replicated share {self.replicated_share:.1%}; buffers {human_bytes(self.buffer_bytes)}"]
        lines += [f"    {dtype:<16} {human_bytes(size):>12}" for dtype, size in sorted(self.parameter_bytes.items())]
        extremes = self.parameter_extremes()
        if extremes and extremes["largest"]["bytes"] != extremes["smallest"]["bytes"]:
            lines.append("  uneven shares: " + ", ".join(
                f"{which} rank {e['rank']} {e['parameter_count']:,} ({human_bytes(e['bytes'])})"
                for which, e in extremes.items()))
        lines.append(f"  {'collective':<16} {'axis':<8} {'count':>6} {'bytes/call':>12} {'bytes/step':>12}")
        for c in self.collectives:
            lines.append(f"  {c.kind:<16} {c.axis:<8} {c.count:>6} {human_bytes(c.bytes_per_call):>12} "
                         f"{human_bytes(c.count * c.bytes_per_call):>12}")
        if not self.collectives:
            lines.append("  (none)")
        lines.append(f"  activation peak per rank (estimate): {human_bytes(self.activation_peak_bytes)}")
        if self.attentions_sharded is not None:
            sharded, total = self.attentions_sharded
            first = next(iter(self.attentions_whole.items()), None)
            lines.append(f"  attentions sequence-sharded {sharded}/{total}"
                         + (f" (left whole: {first[0]}: {first[1]}{' ...' if total - sharded > 1 else ''})"
                            if first else ""))
        if self.hoisted:
            lines.append(f"  host prologue (CPU): {len(self.hoisted)} nodes; "
                         + "; ".join(f"{name}: {why}" for name, why in self.hoisted.items()
                                    if why.kind is HostKind.DATA_DEPENDENT))
        styles = Counter(self.linear_styles.values())
        lines.append("  linears: " + ", ".join(f"{n} {style}" for style, n in sorted(styles.items())))
        for padded, how in self.buckets.items():
            lines.append(f"  bucketed: {padded} {how}")
        if self.specializations:
            lines.append(f"  shape specialisations built: {len(self.specializations)}")
            lines += [f"    {shapes}: {why}" for shapes, why in self.specializations.items()]
        return "\n".join(lines)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _local_numel(node, mesh) -> int:
    """Elements this rank holds, whether meta["val"] is still global (before localize) or already local."""
    val = node.meta["val"]
    if annotation(node).global_shape is not None:
        return val.numel()
    shape = local_shape(val.shape, (annotation(node).placements or {}), mesh)
    return torch.Size(shape).numel()


def _is_view(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


# ops whose schema says "may alias" but which copy when they convert, or when their input is not contiguous
_COPY_WHEN_NEEDED = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
                     torch.ops.aten.to.other, torch.ops.aten.reshape.default, torch.ops.aten.contiguous.default,
                     torch.ops.aten.flatten.using_ints}


def aliases(node) -> bool:
    """Whether ``node``'s value shares its first argument's storage (allocates nothing): a view, an item of a
    multi-output op, a collective's wait; a maybe-copying op (``to``, ``reshape``, ``contiguous``) only when it
    keeps dtype and device and its input is contiguous."""
    source = node.args[0] if node.args else None
    if node.op != "call_function" or not isinstance(source, torch.fx.Node):
        return False
    from ..runtime.collectives import all_gather_wait, reduce_scatter_wait

    # (an all_to_all's wait is a value of its own, even where it joins the pieces in place: the received buffer then
    # lives as long as the joined value, the same bytes, while what was sent is freed at the wait; as a view of the
    # issuing node it would keep the send buffer alive too, and the schedule would overlap by that much more)
    if node.target in (operator.getitem, torch.ops._c10d_functional.wait_tensor.default, reduce_scatter_wait):
        return True
    if node.target is all_gather_wait:  # (uneven pieces are trimmed into a new tensor)
        return len(set(node.args[2])) == 1
    if node.target in _COPY_WHEN_NEEDED:
        before, after = source.meta.get("val"), node.meta.get("val")
        return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype
                and before.device == after.device and before.is_contiguous())
    return _is_view(node)


def nbytes(val) -> int:
    """Bytes of a value; 0 for a data-dependent size (only before hoist_host makes shapes static)."""
    if isinstance(val, torch.Tensor):
        numel = val.numel()
        return numel * val.element_size() if isinstance(numel, int) else 0
    if isinstance(val, (tuple, list)):
        return sum(map(nbytes, val))
    return 0


def held_bytes(node) -> int:
    """The bytes a node's value holds while it lives: the value, and for a collective issued by this package (its
    ``*_start``) also what it sends (a copy of its input, or the input itself), which the collective holds until it
    is waited on (the issuing node's last use): overlapped exchanges hold their send buffers at once."""
    from ..runtime import collectives as c

    held = nbytes(node.meta.get("val"))
    if node.target in c.STARTS:
        held += nbytes(node.args[0].meta.get("val"))
    return held


def _workspace(node) -> int:
    """Bytes an op holds only while it runs: eager rms_norm's intermediate product (a composite of pow, mean,
    rsqrt and two muls), a halo convolution's edge rows with the rows borrowed for them, a ring attention's
    key/value blocks
    in flight (the one it sends on and the one arriving), its float32 partial results (the running output and
    this block's, merged in place) and, off CPU, each block's scores. (An issued collective's buffers are values:
    ``held_bytes``.)"""
    from ..runtime import collectives as c

    if node.target is torch.ops.aten.rms_norm.default:
        return nbytes(node.meta["val"])
    if node.target is c.halo_convolution:  # its edge rows with the borrowed ones (all its rows, if that few)
        x, dim = node.args[0].meta["val"], node.args[7]
        (before, after), rows = node.args[4][dim - 2], x.shape[dim]
        in_place = node.args[3][dim - 2] == 1 and all(p == q for p, q in node.args[4]) and rows >= 2 * before
        return nbytes(x) * 3 * (before + after) // rows if in_place else nbytes(x) * (rows + before + after) // rows
    if node.target in (c.halo_transposed_convolution, c.halo_interpolation):  # its input with the borrowed rows,
        # its uncut output
        x = node.args[0].meta["val"]
        return nbytes(x) + nbytes(node.meta["val"])
    if node.target is not c.ring_attention:
        return 0
    q, k, v = (n.meta["val"] for n in node.args[:3])
    blocks = 2 * nbytes((k, v)) + 2 * q.numel() * 4
    if q.device.type == "cpu":
        return blocks
    # elsewhere (and on meta weights, as the planner sizes it) float32 scores and their softmax are materialised,
    # QUERY_CHUNK query rows at a time: the fused kernel that returns the log-sum-exp is used on CPU only
    chunk = q.numel() // q.shape[-1] // q.shape[-2] * min(q.shape[-2], c.QUERY_CHUNK)
    return blocks + 2 * chunk * max(node.args[4]) * 4


def activation_peak(gm: GraphModule, ctx: PassContext) -> int:
    """Peak bytes of live intermediate values when the graph runs in order and frees each value after its last
    use, plus what an op holds while it runs (``_workspace``). Graph inputs count (the host prologue's outputs
    among them); model tensors are counted as parameters, not here. A view (or an item of a multi-output op)
    allocates nothing but keeps the storage it views alive until its own last use. Allocator caching, other
    kernels' workspaces and fusion are not modelled (``tests/test_memory_estimate.py`` and
    ``benchmarks/sequence_memory.py`` compare it with measured peaks)."""
    model_tensors = {n for n, gi in ctx.placeholder_inputs(gm).items() if gi.is_model_tensor}
    owner = {}  # a view -> the value whose storage it shares
    for node in gm.graph.nodes:
        if aliases(node):
            base = node.args[0]
            owner[node] = owner.get(base, base)
    last_use = {}
    for index, node in enumerate(gm.graph.nodes):
        for source in node.all_input_nodes:
            last_use[owner.get(source, source)] = index
    live, peak, sizes = 0, 0, {}
    for index, node in enumerate(gm.graph.nodes):
        if node not in model_tensors and node.op != "output" and node not in owner:
            sizes[node] = held_bytes(node)
            live += sizes[node]
            peak = max(peak, live + _workspace(node))
        for storage in {owner.get(source, source) for source in node.all_input_nodes}:
            if last_use.get(storage) == index:
                live -= sizes.pop(storage, 0)
    return peak


def collective_calls(node) -> tuple[int, int]:
    """(bytes per call, calls) of one collective node (its annotation's ``collective``) on one rank: the one place
    collectives are sized, so that totals summed per block (``plan_view``) equal the report's."""
    from ..runtime.collectives import (halo_convolution, halo_interpolation, halo_transposed_convolution,
                                       reduce_scatter_start, ring_attention, sharded_group_norm, sharded_layer_norm,
                                       sharded_rms_norm)

    val = node.meta["val"]
    if node.target is halo_convolution:  # the rows borrowed from (and lent to) each neighbour
        x, dim = node.args[0].meta["val"], node.args[7]
        return sum(node.args[4][dim - 2]) * x.numel() // x.shape[dim] * x.element_size(), 1
    if node.target is halo_interpolation:  # reach rows to and from each neighbour
        x, dim = node.args[0].meta["val"], node.args[3]
        return 2 * node.args[4] * x.numel() // x.shape[dim] * x.element_size(), 1
    if node.target is halo_transposed_convolution:
        x, dim = node.args[0].meta["val"], node.args[8]
        return sum(node.args[9:11]) * x.numel() // x.shape[dim] * x.element_size(), 1
    if node.target is reduce_scatter_start:  # sized by what it sums, as an all_reduce of the same value
        val = node.args[0].meta["val"]
    if node.target is ring_attention:  # ring - 1 passes of this rank's key/value block
        k, v = node.args[1].meta["val"], node.args[2].meta["val"]
        return k.numel() * k.element_size() + v.numel() * v.element_size(), len(node.args[4]) - 1
    if node.target in (sharded_rms_norm, sharded_layer_norm):  # float32 row statistics, not the output
        return val.numel() // val.shape[-1] * 4, 1 if node.target is sharded_rms_norm else 2
    if node.target is sharded_group_norm:  # float32 [batch, groups] sums: (sum, count), then spreads
        return val.shape[0] * node.args[1] * 4 * 3 // 2, 2
    return val.numel() * val.element_size(), 1


def collective_stats(gm: GraphModule) -> list[CollectiveStat]:
    calls = defaultdict(int)
    for node in gm.graph.nodes:
        if annotation(node).collective is not None:
            kind, axis = annotation(node).collective
            size, count = collective_calls(node)
            calls[(kind, axis, size)] += count
    return [CollectiveStat(kind, axis, count, size) for (kind, axis, size), count in sorted(calls.items())]


def parameter_extremes(rank_parameters: list[tuple[int, int]]) -> dict[str, dict[str, int]]:
    """Of every rank's (parameter count, bytes), the ranks holding the most and the fewest bytes (ties: the lower
    rank is the largest, the higher the smallest)."""
    ranked = sorted(range(len(rank_parameters)), key=lambda r: (rank_parameters[r][1], -r))
    return {which: {"rank": r, "parameter_count": rank_parameters[r][0], "bytes": rank_parameters[r][1]}
            for which, r in (("largest", ranked[-1]), ("smallest", ranked[0]))} if ranked else {}


def rank_parameters(gm: GraphModule, ctx: PassContext) -> list[tuple[int, int]]:
    """(elements, bytes) of parameters on every rank of the mesh, from each parameter's global shape and
    placements."""
    params = [node for node, gi in ctx.placeholder_inputs(gm).items()
              if gi.kind == "parameter" and isinstance(node.meta.get("val"), torch.Tensor)]
    shapes = [(annotation(node).global_shape or tuple(node.meta["val"].shape), (annotation(node).placements or {}),
               node.meta["val"].element_size()) for node in params]
    totals = []
    for rank in range(ctx.mesh.world_size):
        mesh = replace(ctx.mesh, rank=rank)
        counts = [(torch.Size(local_shape(shape, placements, mesh)).numel(), size)
                  for shape, placements, size in shapes]
        totals.append((sum(n for n, _ in counts), sum(n * size for n, size in counts)))
    return totals


def build_report(gm: GraphModule, ctx: PassContext) -> Report:
    parameters, replicated, buffers = 0, 0, 0
    by_dtype: dict[str, int] = defaultdict(int)
    for node, graph_input in ctx.placeholder_inputs(gm).items():
        if not graph_input.is_model_tensor or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        numel = _local_numel(node, ctx.mesh)
        size = numel * node.meta["val"].element_size()
        if graph_input.kind != "parameter":
            buffers += size
            continue
        parameters += numel
        by_dtype[str(node.meta["val"].dtype).removeprefix("torch.")] += size
        if not any(is_sharded(p) for p in (annotation(node).placements or {}).values()):
            replicated += size
    styles = {path: str(decided) for path, decided in ctx.linear_styles.items()}
    return Report(str(ctx.mesh), parameters, dict(by_dtype), replicated, buffers, collective_stats(gm),
                  activation_peak(gm, ctx), styles, dict(ctx.host.hoisted) if ctx.host else {},
                  dict(ctx.specializations), _buckets(ctx), rank_parameters(gm, ctx),
                  _attentions_sharded(ctx), dict(ctx.sequence_whole))


def _attentions_sharded(ctx: PassContext) -> tuple[int, int] | None:
    """(attentions sequence-sharded over every sequence axis, attentions), without a sequence axis None."""
    if not any(ctx.mesh.size(axis) > 1 for axis in SEQUENCE_AXES):
        return None
    from ..passes.plan_sequence import attention_counts

    return attention_counts(ctx)


def _buckets(ctx: PassContext) -> dict[str, str]:
    """Each bucketed input dim: its buckets and the ops that pick rows from it (proven the only readers)."""
    described = {}
    for (name, dim), sizes in ctx.buckets.items():
        readers = [node for node, (index, padded_dim, _) in ctx.padding_reads.items()
                   if ctx.input_names[index] == name and padded_dim == dim]
        described[f"{name} dim {dim}"] = (f"padded to {list(sizes)}; the padding is read only by indexing "
                                          f"({len(readers)} ops, indices checked per call)" if readers
                                          else f"padded to {list(sizes)}; not read by the device graph")
    return described
