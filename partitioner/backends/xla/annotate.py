"""Running the planned graph on XLA tensors: every value is annotated with its placements, and every edge where the
plan redistributes is annotated again on a copy, so that XLA's SPMD partitioner puts its collectives exactly where
the plan has them."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Interpreter, Node

from ...placement import Shard, is_sharded
from ...rules.attention import ring_split_axes
from ...rules.conv import GROUPS_ARGUMENT
from .errors import XlaBackendError
from .layouts import (Nested, Packed, _fused, _packed_placement, _packed_ranks, nested_uneven, packed_spec,
                      partition_spec)
from .ops import (_SPLITS, _attention, _cat_as_packed, _grouped_conv_packed, _layer_norm, _linear, _moved_packed,
                  _pointwise_packed, _ring_attention, _split_packed)
from ...annotations import annotation

aten = torch.ops.aten


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
        current = (annotation(producer).placements or {})
        required = dict(current)
        for axis, requirements in (annotation(consumer).required or {}).items():
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
        return self._annotate(value, (annotation(node).placements or {}))

    def _call(self, node: Node, args, kwargs):
        target = node.target
        placements = (annotation(node).placements or {})
        if target is aten.cat.default and _packed_placement(placements, self.mesh) is not None:
            packed = _cat_as_packed(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0),
                                    _packed_placement(placements, self.mesh), _packed_ranks(placements, self.mesh))
            if packed is not None:
                return packed
        if target is aten.linear.default:
            return _linear(*args, **kwargs)
        ring_axis = self._ring_axis(node) if target is aten.scaled_dot_product_attention.default else None
        if ring_axis is not None:
            return self._ring(node, ring_axis, args, kwargs)
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
        packed = _pointwise_packed(target, args, kwargs) or _moved_packed(target, args) \
            or (_grouped_conv_packed(target, args) if target in GROUPS_ARGUMENT else None)
        if packed is not None:
            return packed
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), _fused)
        return target(*args, **kwargs)

    def _ring_axis(self, node: Node) -> str | None:
        return next((axis for axis in ring_split_axes(node) if axis in self.mesh.axis_names
                     and self.mesh.size(axis) > 1), None)

    def _ring(self, node: Node, axis: str, args, kwargs):
        """An attention whose keys the ring shards (``ops._ring_attention``). Only equal blocks of a plain sequence
        shard: XLA's tiles are equal, and a packed joint sequence's blocks are not contiguous."""
        q, k, v = args[:3]
        ring, required = self.mesh.size(axis), annotation(node).required
        placements = {a: required[a].get(node.args[1]) for a in required}
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or placements[axis] != Shard(2):  # (packed: !=)
            raise XlaBackendError(f"{node.name}: ring attention over a packed (joint) sequence or padded heads is not "
                                  "lowered to XLA SPMD; use a ulysses axis for this model on XLA, or the eager or "
                                  "inductor backends")
        if q.shape[2] % ring or k.shape[2] % ring:
            raise XlaBackendError(f"{node.name}: {q.shape[2]} query and {k.shape[2]} key rows over a ring of {ring}: "
                                  "XLA's equal tiles need a sequence length the ring degree divides; pad the "
                                  "sequence, pick another ring degree, or use the eager or inductor backends")
        if kwargs.get("attn_mask") is not None or kwargs.get("is_causal") or len(args) > 3:
            raise XlaBackendError(f"{node.name}: masked or causal ring attention is not lowered")
        others = {a: p for a, p in placements.items() if a != axis and is_sharded(p)}
        if any(p.dim >= 2 for p in others.values()):
            raise XlaBackendError(f"{node.name}: its sequence or head_dim is sharded over {sorted(others)} too")
        blocks = {**others, axis: Shard(2)}  # [batch, heads, ring, rows, d]: heads keep their axes

        def annotate(value):
            return _annotate(value, blocks, self.xs, self.xla_mesh, self.mesh_axes)

        return _ring_attention(q, k, v, kwargs.get("scale"), ring, annotate)

    def output(self, target, args, kwargs):
        return torch.fx.node.map_aggregate(args[0], _fused)
