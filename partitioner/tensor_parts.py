"""A tensor subclass (torchao's quantised weights: ``Int8Tensor``, ``Float8Tensor`` ...) as the plain tensors it
holds. Whatever reads a weight's bytes (the weights digest, the memory report, the loader) reads these: the
subclass's own ``numpy()``/``view`` are not defined, and its ``element_size`` is its logical dtype's, not what it
stores. ``torch.export`` unwraps the same subclasses into the same inner tensors (``__tensor_flatten__``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_parts(tensor: torch.Tensor, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """``[(name, plain tensor)]``: the tensor itself when it is plain, else each inner tensor of a traceable
    wrapper subclass (recursively), named ``name.<attribute>`` in the order ``__tensor_flatten__`` gives."""
    if not is_traceable_wrapper_subclass(tensor):
        return [(name, tensor)]
    attributes, _ = tensor.__tensor_flatten__()
    parts = []
    for attribute in attributes:
        parts += plain_parts(getattr(tensor, attribute), f"{name}.{attribute}" if name else attribute)
    return parts


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor stores: the sum over its plain parts (an int8 weight and its float32 scales)."""
    return sum(part.numel() * part.element_size() for _, part in plain_parts(tensor))


def flattened_name(part: str, parameter: str) -> str:
    """torchao's name in a safetensors checkpoint (``flatten_tensor_state_dict``, what diffusers' ``save_pretrained``
    writes for a model loaded with ``TorchAoConfig``) of ``part`` ("to_q.weight.qdata") of ``parameter``
    ("to_q.weight"): "to_q._weight_qdata"."""
    module, _, name = parameter.rpartition(".")
    flat = f"_{name}_{part.removeprefix(parameter + '.')}"
    return f"{module}.{flat}" if module else flat


def is_wrapped(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and is_traceable_wrapper_subclass(tensor)
