"""What the ranks compare besides shapes: digests of tensor values.

A call's input tensors (``values_digest``: a fixed strided sample of each, hashed on the host or summed in float64
on an accelerator, or every byte hashed) and a model's weights (``weights_digest``, sampled), so that ranks called
with other latents, or holding other weights, fail together instead of returning an output that matches neither
(``agreement`` carries the digests in its all_reduces). ``call_signature`` is the int64 the per-call agreement
compares for shapes, dtypes, structure and constants.
"""

from __future__ import annotations

import enum
import hashlib
import struct

import torch
import torch.utils._pytree as pytree

from ..errors import InputError
from ..tensor_parts import plain_parts

FINGERPRINTS = ("sample", "full", "off")  # partition(..., input_fingerprint=)
SAMPLE = 4096  # elements of each input tensor the "sample" fingerprint reads
_WEIGHTS: dict[tuple, torch.Tensor] = {}  # the sample sum's fixed weights, per (length, device)
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(tensor: torch.Tensor, sample: bool = False) -> bytes:
    """A tensor's bytes (with ``sample``, those of up to ``SAMPLE`` elements at a fixed stride), through numpy: a
    few microseconds for a small tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = (_sample(tensor) if sample else tensor).cpu()
    try:
        array = tensor.numpy()
    except TypeError:  # no numpy dtype (bfloat16, float8): the same bytes as integers
        array = tensor.view(_SAME_SIZE[tensor.element_size()]).numpy()
    except RuntimeError:  # a conjugate or negative view
        array = tensor.resolve_conj().resolve_neg().numpy()
    array = array.reshape(-1)
    if sample and array.size > SAMPLE:
        array = array[::array.size // SAMPLE][:SAMPLE]
    return array.tobytes()


def value_digest(tensor: torch.Tensor) -> str:
    """A tensor's values in a short string (for inputs a partition is specialised on: masks, lengths)."""
    return hashlib.sha256(_bytes(tensor)).hexdigest()[:16]


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """Up to ``SAMPLE`` elements of ``tensor`` at a fixed stride: the same elements on every rank for one shape."""
    flat = tensor.detach().reshape(-1)
    return flat[::max(1, flat.numel() // SAMPLE)][:SAMPLE]


def _sample_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 weighted sum of ``_sample(tensor)``, on the tensor's device (an accelerator's: no transfer per
    tensor), a number that differs, with high probability, between tensors of other values (weighted: it also sees
    rows swapped)."""
    sample = _sample(tensor)
    if sample.is_complex():
        sample = torch.view_as_real(sample).reshape(-1)
    sample = sample.to(torch.float64)
    key = (sample.numel(), sample.device)
    weights = _WEIGHTS.get(key)
    if weights is None:  # 1 + frac(i * golden ratio): fixed, distinct, never 0
        weights = _WEIGHTS[key] = 1 + torch.arange(sample.numel(), dtype=torch.float64, device=sample.device) \
            .mul(0.6180339887498949).frac()
    return (sample * weights).sum()


def _fingerprint_parts(values, mode: str, exact) -> tuple[list[tuple[str, bytes]], list[tuple[str, torch.Tensor]]]:
    """Each input's fingerprint as bytes where it is made on the host (hashed whole: ``exact`` inputs and mode
    "full"; CPU tensors under "sample": the sampled elements' bytes), and the accelerator tensors whose sampled sums
    are still to be brought over."""
    on_host, on_device = [], []
    for name, tensor in values:
        if name in exact or mode == "full":
            on_host.append((name, _bytes(tensor)))
        elif mode == "sample" and tensor.device.type in ("cpu", "meta"):
            on_host.append((name, _bytes(tensor, sample=True) if not tensor.is_meta else b"meta"))
        elif mode == "sample":
            on_device.append((name, tensor))
    return on_host, on_device


def _device_sums(on_device: list[tuple[str, torch.Tensor]]) -> list[tuple[str, float]]:
    """The sampled sums of accelerator tensors, one host transfer per device."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in on_device:
        by_device.setdefault(tensor.device, []).append((name, tensor))
    sums = []
    for group in by_device.values():
        numbers = torch.stack([_sample_sum(tensor) for _, tensor in group]).tolist()
        sums += [(name, number) for (name, _), number in zip(group, numbers)]
    return sums


def values_digest(values: list[tuple[str, torch.Tensor]], mode: str, exact=frozenset()) -> str:
    """One digest of every input's fingerprint (``fingerprints``), cheap enough for every call: one hash."""
    on_host, on_device = _fingerprint_parts(values, mode, exact)
    digest = hashlib.sha256(mode.encode())
    for _, data in on_host:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    for _, number in _device_sums(on_device):
        digest.update(struct.pack("<d", number))
    return digest.hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of a model's parameters and buffers (``SAMPLE`` elements of each at a fixed stride), which every
    rank's plan check compares: ranks whose models hold other weights (built unseeded, another checkpoint) refuse
    together instead of running a mixture. Tensors on the meta device count by name, shape and dtype only; a tensor
    subclass (a quantised weight) by each of its plain parts."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name} {list(tensor.shape)} {tensor.dtype}".encode())
        for part_name, part in plain_parts(tensor):  # a quantised weight: its payload and scales
            digest.update(f"{part_name} {list(part.shape)} {part.dtype}".encode())
            if not part.is_meta:
                digest.update(_bytes(part, sample=True))
    return digest.hexdigest()[:16]


def fingerprints(values: list[tuple[str, torch.Tensor]], mode: str, exact=frozenset()) -> list[tuple[str, str]]:
    """Each named input tensor's fingerprint, in words: ``mode`` "sample" (up to ``SAMPLE`` elements at a fixed
    stride: their bytes hashed for a CPU tensor, a float64 weighted sum on an accelerator), "full" (a hash of every
    byte), "off" (none); inputs named in ``exact`` (a partition is specialised on their values) always hashed
    whole."""
    on_host, on_device = _fingerprint_parts(values, mode, exact)
    found = dict((name, hashlib.sha256(data).hexdigest()[:16]) for name, data in on_host)
    found.update((name, repr(number)) for name, number in _device_sums(on_device))
    return [(name, found[name]) for name, _ in values if name in found]


def leaf_key(value, *, generator_state: bool = True):
    """What a call argument changes in the computation, comparable between ranks and calls: a tensor's shape and
    dtype; a generator's device and (with ``generator_state``) a digest of its state, so that ranks seeded
    differently still differ (a partitioned graph draws nothing from it: randomness in a forward is refused); a
    function by its qualified name; a plain value (number, string, None, enum, dtype, device) by its repr; any
    other object by its type. Never a repr that holds a memory address, which differs on every rank."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, torch.Generator):
        return ("generator", str(value.device)) + ((value_digest(value.get_state()),) if generator_state else ())
    if callable(value) and hasattr(value, "__qualname__"):
        return "callable", getattr(value, "__module__", ""), value.__qualname__
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype,
                                           torch.device, torch.Size, range, slice)):
        return repr(value)
    return "object", type(value).__module__, type(value).__qualname__


def same_constant(given, traced) -> bool:
    """Whether a call's non-tensor argument is the traced constant: equal values, or for a generator one of the
    same device (the graph draws nothing from it)."""
    if isinstance(traced, torch.Generator):
        return isinstance(given, torch.Generator) and given.device == traced.device
    return type(given) is type(traced) and given == traced


def call_signature(values: list, exact=(), structure: pytree.TreeSpec | None = None) -> int:
    """A number that is equal on two ranks when their calls have the same shapes, dtypes and constants, the same
    values at the indices in ``exact`` and the same ``structure`` (the call's pytree spec: two state objects whose
    tensors sit under other attribute names flatten to equal leaves)."""
    described = [leaf_key(v) for v in values] + [structure_key(structure)]
    described += [value_digest(values[i]) for i in sorted(exact)]
    return _number(repr(described))


def structure_key(spec: pytree.TreeSpec | None):
    """A call's pytree structure, comparable between ranks: each node's type and context, the context's values as
    ``leaf_key`` describes them (a TreeSpec's repr prints a defaultdict's factory or a registered constant with its
    address, which differs on every rank)."""
    if spec is None or spec.is_leaf():
        return None
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs  # (torch 2.9)
    return (leaf_key(spec.type), _context_key(spec.context), [structure_key(child) for child in children])


def _context_key(context):
    if isinstance(context, (list, tuple)):
        return [_context_key(part) for part in context]
    return leaf_key(context, generator_state=False)  # (a type or a function by its qualified name)


def _number(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def check_fingerprint(mode) -> str:
    if mode not in FINGERPRINTS:
        raise InputError(f"input_fingerprint={mode!r}: use one of {list(FINGERPRINTS)} ('sample': a float64 sum "
                         "over a fixed sample of each input tensor, 'full': a hash of every byte, 'off': none)")
    return mode
