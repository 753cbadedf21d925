"""The ranks' device in the graph: how it lays a value out, for the order an exchange sends its pieces in
(``insert_collectives``: a model traced on the meta device has the layouts of meta kernels, which can differ from
the device's own), and ops that create tensors pointed at it (``place_graph_on``)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch.fx import Node

from .regions import fake_metadata


def strides_on_device(node: Node, device_type: str) -> tuple:
    """``node``'s strides as the ranks' device lays its value out. A model traced on the meta device has the
    layouts of meta kernels: an attention's output contiguous in [batch, heads, rows, dim], which CPU's fused
    kernel writes as a transpose of [batch, rows, heads, dim]. The op is run again on fake tensors of that device,
    its inputs laid out as traced (remembered by those layouts: 50 blocks ask for the same few ops); the traced
    strides where it cannot run there (a device this host cannot fake)."""
    val = node.meta["val"]
    if not val.is_meta or device_type == "meta" or node.op != "call_function":
        return val.stride()
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
    arguments = fake_metadata((*args, *kwargs.values()))
    if arguments is None:  # a symbolic size: its strides say no order either
        return val.stride()
    key = (device_type, node.target, arguments, tuple(kwargs))
    if key not in _MADE:
        _MADE[key] = _made_on(node, device_type)
        if len(_MADE) > _REMEMBERED:
            _MADE.popitem(last=False)
    _MADE.move_to_end(key)
    return _MADE[key] or val.stride()


_REMEMBERED = 512  # op and input layouts whose device layout is kept (a model asks for a few dozen)
_MADE: OrderedDict[tuple, tuple | None] = OrderedDict()


def _made_on(node: Node, device_type: str) -> tuple | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def on_device(arg: Node):
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise TypeError(f"{arg.name} is no tensor")
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device_type)
    try:
        with FakeTensorMode():
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), on_device)
            made = node.target(*args, **kwargs)
    except Exception as error:  # (only the order an exchange sends its pieces in depends on it: every order is exact)
        logging.getLogger("partitioner").debug("%s: no %s layout (%s); the traced one is used", node.name,
                                               device_type, error)
        return None
    return made.stride() if isinstance(made, torch.Tensor) and made.shape == node.meta["val"].shape else None


def memory_order(strides: tuple) -> list[int] | None:
    """The dims from outermost to innermost in memory (None: the logical order, or strides unknown).
    An exchange sends its pieces in this order: an attention's output, laid out [batch, rows, heads, dim] under its
    [batch, heads, rows, dim] shape, is split by rows without a copy and joined by heads with one (in logical order:
    a copy on each side), and its input, split by heads, arrives already joined by rows."""
    if not all(isinstance(stride, int) for stride in strides):
        return None
    order = sorted(range(len(strides)), key=lambda dim: -strides[dim])  # (stable: ties keep their logical order)
    return None if order == list(range(len(order))) else order


def place_graph_on(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Point ops that create tensors (arange, zeros, ...) at ``device``: the trace baked in its own (meta, cpu)."""
    changed = False
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
            node.update_kwarg("device", device)
            changed = True
    if changed:
        gm.recompile()
