"""``Partitioned.verify``: run this rank's program and the unpartitioned model on the same inputs, and name the first
value that differs.

The reference is the planned graph (the traced model before any collective or local shape) run on the model's
whole tensors; its outputs are first checked against the model's own forward. This rank's program runs node by
node; every value it computes is compared with the reference value cut to this rank's part by the value's
placements (a shard is the rank's slice; a partial sum is skipped, its reduced successor is checked). The first node
in program order whose value differs, on any rank, is reported on every rank with its model source line, its
placements, the pass that decided each, and the error. All ranks must call ``verify`` together (it runs the
program's collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Interpreter, Node

from ..tensor_parts import plain_parts
from ..errors import VerificationError
from ..frontend.state_objects import written_tensors
from ..frontend.trace import bind_forward
from ..source import source_line
from ..placement import PackedShard, Partial, delivery_order, is_sharded, shorthand, slice_local, split_order
from ..passes.device_layout import place_graph_on
from ..annotations import annotation


@dataclass
class Mismatch:
    rank: int
    position: int  # the node's index in the program
    node: str
    error: float
    scale: float
    message: str


@dataclass
class VerifyResult:
    """What ``verify`` compared: values checked on this rank, the largest error among them and at the outputs."""
    nodes_checked: int
    max_error: float
    output_error: float


class _Recorder(Interpreter):
    def __init__(self, gm: GraphModule):
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, node: Node):
        result = super().run_node(node)
        if node.op != "output":
            self.values[node.name] = result
        return result


def _local_part(value, placements: dict, mesh):
    """This rank's part of a whole reference value, or None where it holds a partial sum."""
    if isinstance(value, (tuple, list)):
        return [_local_part(v, {a: p[i] if isinstance(p, tuple) else p for a, p in placements.items()}, mesh)
                for i, v in enumerate(value)]
    if not isinstance(value, torch.Tensor):
        return value
    for axis in split_order(placements, mesh):
        placement = placements.get(axis)
        if isinstance(placement, Partial):
            return None
        if is_sharded(placement):
            value = slice_local(value, placement, mesh.size(axis), mesh.coordinate(axis))
    return value


def _as_delivered(node: Node, value, mesh):
    """An attention over a packed joint sequence runs on rows in rank order (each rank's part of every block in
    turn, as the exchange delivers them; keys and values alike): its reference output, reordered so."""
    order = annotation(node.args[0]).rank_order if node.target is torch.ops.aten.scaled_dot_product_attention.default \
        else None
    if order is None or not isinstance(value, torch.Tensor):
        return value
    axis, blocks = order
    ranges = delivery_order(PackedShard(2, blocks), value.shape[2], mesh.size(axis))
    return torch.cat([value.narrow(2, start, end - start) for start, end in ranges], 2)


def _error(local, expected) -> tuple[float, float]:
    """Largest absolute difference and the reference's largest magnitude, over every tensor of a value."""
    pairs = [(a, b) for a, b in zip(pytree.tree_leaves(local), pytree.tree_leaves(expected))
             if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)]
    error = scale = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return float("inf"), 0.0
        if a.numel() and (a.is_floating_point() or b.is_floating_point()):
            error = max(error, (a.double() - b.double().to(a.device)).abs().max().item())
            scale = max(scale, b.double().abs().max().item())
        elif a.numel() and not torch.equal(a.cpu(), b.cpu()):
            error = float("inf")
    return error, scale


def _describe(node: Node, error: float, scale: float, rank: int) -> str:
    placements = (annotation(node).placements or {})
    placed_by = (annotation(node).placed_by or {})
    decided = ", ".join(f"{axis}={_shorthand(p)} (by {placed_by.get(axis, '?')})" for axis, p in placements.items())
    return (f"rank {rank}: {node.name} = {getattr(node.target, '__name__', node.target)} differs from the "
            f"unpartitioned model by {error:.3g} (reference magnitude {scale:.3g}); model line: {source_line(node)}; "
            f"placements: {decided or 'none'}")


def _shorthand(placement) -> str:
    return "(" + ", ".join(map(shorthand, placement)) + ")" if isinstance(placement, tuple) else shorthand(placement)


def verify(partitioned, model: torch.nn.Module, args, kwargs, *, rtol: float, atol: float) -> VerifyResult:
    """``_verify`` on every rank; a collective that fails or times out (a peer that did not call verify) marks the
    partition unusable and is a ``CollectiveTimeout``."""
    from ..errors import CollectiveTimeout, PartitionerError
    from .rank_groups import first_line, forget

    guard = partitioned.guard
    guard.check_usable()
    try:
        return _verify(partitioned, model, args, kwargs, rtol=rtol, atol=atol)
    except PartitionerError:
        raise
    except RuntimeError as error:
        if guard.groups is None:
            raise
        guard.broken = f"verify() failed in a collective: {first_line(error)}"
        forget(guard.groups)
        raise CollectiveTimeout(f"verify() on rank {partitioned.mesh.rank}: a collective did not complete within "
                                f"{guard.groups.timeout:g} s, or failed ({first_line(error)}): every rank must call "
                                "verify() with the same inputs; the partition's message streams may now be out of "
                                "step, so it is unusable: partition the model again on every rank") from error


def _verify(partitioned, model: torch.nn.Module, args, kwargs, *, rtol: float, atol: float) -> VerifyResult:
    from .program import CompiledPartition

    mesh = partitioned.mesh
    runner = CompiledPartition(partitioned.graph_module, partitioned, "eager-verify")
    flat, user, *_ = runner.flatten(args, kwargs)
    hosted, _ = runner.run_host(flat) if runner.host is not None else ([], {})
    with torch.no_grad():
        writes = partitioned.traced.state_writes
        if writes:  # the eager model writes into copies of the call's state objects (the graph returns its writes)
            args, kwargs = pytree.tree_map(lambda leaf: leaf, (args, kwargs))
        expected_out = model(*args, **kwargs)
        if writes:
            named = bind_forward(partitioned.traced.signature, args, kwargs, type(model).__name__)
            expected_out = (expected_out, written_tensors(named, writes))
        whole = _whole_state(partitioned, model)
        reference = _Recorder(_on(partitioned.planned_graph, runner.device))
        tensors = [whole[gi.target] for gi in partitioned.ctx.inputs if gi.is_model_tensor]
        reference_out = reference.run(*tensors, *user, *hosted)
        local = _Recorder(_on(partitioned.graph_module, runner.device))
        local_out = local.run(*runner.state, *user, *hosted)

    def tolerated(error, scale):
        return error <= atol + rtol * scale

    trace_error, trace_scale = _error(list(reference_out), pytree.tree_leaves(expected_out))
    mismatch = None
    if not tolerated(trace_error, trace_scale):
        mismatch = Mismatch(mesh.rank, -1, "output", trace_error, trace_scale,
                            f"the traced graph itself differs from the model's forward by {trace_error:.3g}: the trace "
                            "(torch.export) or the host prologue is at fault, not a sharding decision")
    checked, worst = 0, 0.0
    for position, node in enumerate(partitioned.graph_module.graph.nodes):
        if mismatch is not None:
            break
        if node.name not in reference.values or node.name not in local.values or annotation(node).placements is None:
            continue
        expected = _local_part(_as_delivered(node, reference.values[node.name], mesh), annotation(node).placements,
                               mesh)
        if expected is None or any(e is None for e in (expected if isinstance(expected, list) else ())):
            continue
        error, scale = _error(local.values[node.name], expected)
        checked += 1
        worst = max(worst, error)
        if not tolerated(error, scale):
            mismatch = Mismatch(mesh.rank, position, node.name, error, scale, _describe(node, error, scale, mesh.rank))
    output_error, output_scale = _error(list(local_out), list(reference_out))
    if mismatch is None and not tolerated(output_error, output_scale):
        mismatch = Mismatch(mesh.rank, 1 << 30, "output", output_error, output_scale,
                            f"rank {mesh.rank}: the outputs differ by {output_error:.3g} though no value did")
    found = _gather(mismatch, partitioned)
    if found:
        first = min(found, key=lambda m: (m.position, m.rank))
        others = sorted({m.rank for m in found} - {first.rank})
        raise VerificationError(first.message + (f" (ranks {others} also differ)" if others else ""))
    return VerifyResult(checked, worst, output_error)


def _on(gm: GraphModule, device: torch.device) -> GraphModule:
    place_graph_on(gm, device)
    return gm


def _whole_state(partitioned, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every model tensor the graph takes, whole: from the model where this rank holds a slice of it."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    whole = {}
    for gi in partitioned.ctx.inputs:
        if not gi.is_model_tensor:
            continue
        if gi.target in partitioned.slice_specs:
            tensor = named.get(gi.target)
            if gi.part_of is not None and gi.part_of in named:  # a quantised weight's payload or scales
                tensor = dict(plain_parts(named[gi.part_of], gi.part_of)).get(gi.target)
            if tensor is None:
                raise VerificationError(f"verify needs the whole {gi.target!r}, which the model does not hold")
            whole[gi.target] = tensor.detach().to(partitioned.state[gi.target].device)
        else:
            whole[gi.target] = partitioned.state[gi.target]
    return whole


def _gather(mismatch: Mismatch | None, partitioned) -> list[Mismatch]:
    group = partitioned.guard.group if partitioned.guard is not None else None
    if group is None:
        return [mismatch] if mismatch else []
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, mismatch, group=group)
    return [m for m in gathered if m is not None]
