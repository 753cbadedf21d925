"""Tracing a model built on the meta device (to be filled by ``load_weights``): its example inputs go to meta, the
buffers ``init_empty_weights`` keeps real are traced as meta and kept, autocast asked for on "meta" is traced
as CPU autocast, and flex_attention's device check lets meta inputs through."""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree


class _MetaAutocastAsCpu(torch.autocast):
    """``torch.autocast("meta", ...)`` (a model on the meta device asking for autocast on its own device, as
    Mochi's rotary does) is unsupported; traced as CPU autocast, and checked by ``inline_plain_autocast``."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def autocast_on_meta(model: torch.nn.Module):
    if not any(p.is_meta for p in model.parameters()):
        yield
        return
    original, torch.autocast = torch.autocast, _MetaAutocastAsCpu
    try:
        yield
    finally:
        torch.autocast = original


@contextlib.contextmanager
def flex_attention_on_meta(model: torch.nn.Module):
    """flex_attention refuses meta inputs before it records its op (a check of the devices it has kernels for); the
    trace needs only shapes, and the partition runs the recorded op on the real device, where the check holds."""
    from torch.nn.attention import flex_attention

    check = getattr(flex_attention, "_validate_device", None)
    if check is None or not any(p.is_meta for p in model.parameters()):
        yield
        return

    def on_meta_too(query, key, value):
        if query.device.type != "meta":
            check(query, key, value)
    flex_attention._validate_device = on_meta_too
    try:
        yield
    finally:
        flex_attention._validate_device = check


def inputs_on_meta(model: torch.nn.Module, named: dict) -> dict:
    """A model built on the meta device (to be filled by ``load_weights``) traced with real example inputs, as a
    pipeline hands them over: the trace needs only their shapes and dtypes, so they go to the meta device too."""
    if not any(p.is_meta for p in model.parameters()):  # (buffers may be real: init_empty_weights keeps them)
        return named
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.to("meta"), named)


def real_buffers_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that are not on meta of a model whose parameters are (accelerate's ``init_empty_weights`` keeps
    buffers real, ``rope.inv_freq`` among them), by name."""
    if not any(p.is_meta for p in model.parameters()):
        return {}
    return {name: b for name, b in model.named_buffers() if not b.is_meta}


@contextlib.contextmanager
def buffers_on_meta(model: torch.nn.Module, real: dict[str, torch.Tensor]):
    """``real`` buffers replaced by meta ones while the model is traced on meta inputs (a real buffer beside meta
    parameters and inputs is a device mismatch); the trace's state takes the real values back."""
    owners = []
    for name, tensor in real.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        owners.append((module, leaf, tensor))
        module._buffers[leaf] = tensor.to("meta")
    try:
        yield
    finally:
        for module, leaf, tensor in owners:
            module._buffers[leaf] = tensor
