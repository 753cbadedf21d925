"""chunk_reductions: overlap a row-parallel linear's all_reduce with its own matmul ("collective matmul").

Requires: localize has run (this rank's shapes).
Guarantees: a row-parallel linear whose all_reduce the cost model says is worth hiding is computed in row chunks:
chunk i's all_reduce is issued before chunk i+1's matmul, so the sum of chunk i travels while chunk i+1 is
computed, and the chunks are concatenated after their waits. A linear and a sum over ranks both act row by row,
so the result holds the same values (the same products summed in the same order, row by row).

The cost rule, with t_m the matmul's time and t_c the all_reduce's on the device profile (``partitioner.planning.cost``):
n chunks take max(t_m, t_c) + min(t_m, t_c) / n (a two-stage pipeline; where the profile's ``overlap`` share is
below 1, only that share of the overlapped time is saved) plus, per extra chunk, one more message's latency, and
the concatenation's copy once; the n in ``CHUNKS`` with the least time wins if it saves at least
``MIN_SAVING`` of the time, else one chunk (no change). Every rank of a group must issue the same collectives: the choice is made from rank-independent figures
(rank 0's shapes; the fewest rows any rank holds), never from this rank's own.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

from ..decisions import Chunking
from ..errors import InvariantError
from ..placement import local_shape
from ..planning.cost import collective_s, load_profile
from .annotate_heads import module_path
from .context import PassContext
from ..annotations import annotation

aten = torch.ops.aten
functional = torch.ops._c10d_functional
CHUNKS = (1, 2, 4, 8)
MIN_CHUNK_ROWS = 64  # below this a matmul's rows no longer fill the device's tiles
MIN_SAVING = 0.05  # chunks must save this share of the estimated time: the estimate is not finer than that


def _row_parallel(reduce: Node) -> Node | None:
    """The linear an all_reduce sums, when it is a bias-free linear read by nothing else and the sum is waited on
    once (insert_collectives moves a row-wise bias after the wait)."""
    linear = reduce.args[0]
    if (linear.target is not aten.linear.default or (len(linear.args) > 2 and linear.args[2] is not None)
            or len(linear.users) != 1 or len(reduce.users) != 1 or reduce.args[1] != "sum"):
        return None
    return linear if linear.meta["val"].dim() >= 2 else None


def _rank_shape(node: Node, mesh) -> list[int]:
    return local_shape(annotation(node).global_shape, annotation(node).placements, mesh)


def _chunks(linear: Node, reduce: Node, ctx: PassContext, profile) -> tuple[int, str]:
    """How many row chunks, and why: from rank 0's shapes and the fewest rows any rank of the mesh holds."""
    first = dataclasses.replace(ctx.mesh, rank=0)
    x, w = _rank_shape(linear.args[0], first), _rank_shape(linear.args[1], first)
    rows = min(_rank_shape(linear, dataclasses.replace(ctx.mesh, rank=r))[-2] for r in range(ctx.mesh.world_size))
    size = linear.meta["val"].element_size()
    m = torch.Size(x[:-1]).numel()
    out_bytes = m * w[0] * size
    t_m = max(2 * m * w[0] * w[1] / (profile.matmul_tflops * 1e12),
              (m * w[1] + w[0] * w[1]) * size / (profile.memory_gbps * 1e9) + out_bytes / (profile.memory_gbps * 1e9))
    axis = annotation(reduce).collective[1]
    groups = first.groups(axis)
    group = next(g for g in groups if 0 in g)
    t_c = collective_s("all_reduce", out_bytes, group, groups, profile)
    latency = collective_s("all_reduce", 0, group, groups, profile)
    concat = 2 * out_bytes / (profile.memory_gbps * 1e9)

    def seconds(n: int) -> float:  # (the profile's overlap: the share of the pipelined time actually hidden)
        hidden = profile.overlap * min(t_m, t_c) * (1 - 1 / n)
        return t_m + t_c - hidden + (n - 1) * latency + (concat if n > 1 else 0.0)

    possible = [n for n in CHUNKS if rows // n >= MIN_CHUNK_ROWS]
    best = min(possible, key=lambda n: (seconds(n), n)) if possible else 1
    if seconds(best) > (1 - MIN_SAVING) * seconds(1):
        best = 1
    why = (f"matmul {t_m * 1e3:.3g} ms, all_reduce {t_c * 1e3:.3g} ms on {profile.name}: "
           f"{seconds(1) * 1e3:.3g} ms whole, {seconds(best) * 1e3:.3g} ms in {best} chunks of {rows // best}+ rows")
    return best, why


def _like(node: Node, like: Node, val, region_only: bool = False) -> Node:
    """``node`` placed and named as ``like`` (its region only, with ``region_only``), with the value ``val``."""
    if "nn_module_stack" in like.meta:
        node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    if not region_only:
        annotation(node).placements = annotation(like).placements
        annotation(node).collective = annotation(like).collective
    node.meta["val"], annotation(node).global_shape = val, None  # (a chunk has no global shape of its own)
    return node


def _split(linear: Node, reduce: Node, wait: Node, n: int) -> None:
    """linear -> all_reduce -> wait becomes, per chunk, slice -> linear -> all_reduce, then the waits and a cat."""
    graph, dim = linear.graph, linear.meta["val"].dim() - 2
    x, weight = linear.args[0], linear.args[1]
    rows = linear.meta["val"].shape[dim]
    sizes = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    reduces = []
    for start, size in zip(starts, sizes):
        with graph.inserting_before(linear):
            piece = _like(graph.call_function(aten.slice.Tensor, (x, dim, start, start + size)), linear,
                          x.meta["val"].narrow(dim, start, size), region_only=True)  # (in the linear's region)
            annotation(piece).placements = annotation(x).placements
            part = _like(graph.call_function(aten.linear.default, (piece, weight)), linear,
                         linear.meta["val"].narrow(dim, start, size))
            reduces.append(_like(graph.call_function(functional.all_reduce.default, (part, *reduce.args[1:])),
                                 reduce, part.meta["val"]))
    waits = []
    for chunk in reduces:
        with graph.inserting_before(wait):
            waits.append(_like(graph.call_function(functional.wait_tensor.default, (chunk,)), wait,
                               chunk.meta["val"]))
    with graph.inserting_before(wait):
        joined = _like(graph.call_function(aten.cat.default, (waits, dim)), wait, wait.meta["val"])
    wait.replace_all_uses_with(joined)
    for node in (wait, reduce, linear):
        graph.erase_node(node)


def run(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if not ctx.overlap.chunk_reductions or ctx.mesh.world_size == 1:
        return gm
    profile = load_profile(ctx.overlap.profile_for(ctx.mesh.device_type))
    for reduce in [n for n in gm.graph.nodes if n.target is functional.all_reduce.default]:
        linear = _row_parallel(reduce)
        if linear is None:
            continue
        n, why = _chunks(linear, reduce, ctx, profile)
        path = module_path(linear) or linear.name
        ctx.chunked[path] = Chunking(n, why)
        if n > 1:
            _split(linear, reduce, next(iter(reduce.users)), n)
    return gm


def check(gm: GraphModule, ctx: PassContext) -> None:
    """Postcondition: every all_reduce is waited on exactly once."""
    for node in gm.graph.nodes:
        if node.target is functional.all_reduce.default and len(node.users) != 1:
            raise InvariantError(f"{node.name}: an all_reduce with {len(node.users)} waits")
