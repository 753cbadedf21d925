"""AWS Neuron (Trainium): the rules Neuron enforces, checked on a rank's graph on any CPU, then torch-neuronx.

Each rule says what fails on hardware and how to fix it, so a layout can be checked on a laptop before renting a
Trainium host. The rules (from torch-neuronx's documented behaviour and what was seen running MiniMax-H3):

- collectives: only all_reduce, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single exist;
- all-to-all groups: consecutive ranks (the mesh check already ensures it) of 4, 8, 16 or a multiple of 32 ranks;
- attention: query and key lengths multiples of 512, head_dim <= 128, no attention mask, no dropout, else
  torch-neuronx silently falls back from its NKI flash kernel to materialising the whole score matrix, whose
  compile never finishes at H3 sizes;
- static shapes, and no float64;
- no copy to the CPU inside the device graph (Neuron ops refuse non-scalar CPU tensors): data-dependent work runs
  in the host prologue, whose results are explicit transfers, and ops that create tensors are pointed at the rank's
  device when compiling.

Before checking, ``legalize`` rewrites a copy of the graph as Neuron wants it (``passes/narrow_indices.py``,
``passes/pad_attention.py``):
- int64 tensors used only as indices become int32; graph inputs among them are range-checked and cast at each call;
- with ``pad_sequence=True``, every attention whose query or key length is not a multiple of 512 is padded to one,
  exactly (no mask: padded keys are normalised out by a second attention, so attention costs twice as much).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .. import collectives
from ..errors import BackendError
from ..passes import narrow_indices, pad_attention
from ..trace import copy_graph_module
from .base import Backend, register

_COLLECTIVES = {torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_gather_into_tensor.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default,
                torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.wait_tensor.default,
                collectives.all_gather, collectives.all_to_all, collectives.sharded_rms_norm,
                collectives.sharded_layer_norm}
# Ops that move data to another device (creation ops are pointed at the rank's device when compiling).
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout}
BLOCK = 512  # sequence lengths the NKI flash-attention kernel accepts are multiples of this
MAX_HEAD_DIM = 128


class NeuronLegalityError(BackendError, ValueError):
    pass


def valid_all_to_all_size(size: int) -> bool:
    return size in (1, 4, 8, 16) or size % 32 == 0


def sequence_length_advice(length: int, text_rows: int | None = None) -> str:
    """The nearest lengths the flash kernel accepts, and how many text rows to trim or add to reach them."""
    below, above = length // BLOCK * BLOCK, -(-length // BLOCK) * BLOCK
    options = [f"{above} (add {above - length} rows)"]
    if below:
        trim = f"trim {length - below} rows" + ("" if text_rows is None or length - below <= text_rows
                                                else f", more than the {text_rows} text rows")
        options.insert(0, f"{below} ({trim})")
    return f"packed length {length} is not a multiple of {BLOCK}; nearest valid: " + " or ".join(options)


def check(gm: GraphModule, mesh, text_rows: int | None = None) -> list[str]:
    """Every way this rank's graph would fail or fall back on Neuron, as actionable messages (empty: legal)."""
    problems = []
    ulysses = mesh.size("ulysses")
    if ulysses > 1 and not valid_all_to_all_size(ulysses):
        valid = [n for n in (4, 8, 16, 32, 64) if n <= max(mesh.world_size, 4)]
        problems.append(f"all-to-all over {ulysses} ranks: Neuron accepts groups of 4, 8, 16 or a multiple of 32; "
                        f"use a ulysses degree of {valid}")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "_c10d_functional" in str(node.target) and node.target not in _COLLECTIVES:
            problems.append(f"{node.name}: {node.target} is not a collective Neuron supports")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.dtype == torch.float64:
                problems.append(f"{node.name}: float64 is not supported on Neuron; compute in float32")
            if any(not isinstance(size, int) for size in val.shape):
                problems.append(f"{node.name}: dynamic shape {list(val.shape)}; Neuron compiles static shapes")
        device = node.kwargs.get("device")
        if node.target is torch.ops.aten.to.device and len(node.args) > 1:
            device = node.args[1]
        if (node.target in _COPIES and isinstance(device, torch.device) and device.type == "cpu"
                and isinstance(val, torch.Tensor) and val.dim()):
            problems.append(f"{node.name}: copies a tensor {list(val.shape)} to the CPU inside the device graph; "
                            "Neuron ops refuse non-scalar CPU tensors (data-dependent work belongs in the host "
                            "prologue)")
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            problems += _attention_problems(node, text_rows)
        if node.target is collectives.ring_attention:
            problems.append(f"{node.name}: ring attention is not lowered for Neuron yet (it passes key/value blocks "
                            "with all_to_all pieces of size zero, which Neuron's all-to-all groups are not known to "
                            "accept); use a ulysses axis instead of ring")
    return list(dict.fromkeys(problems))  # a padded attention's two calls would report the same head_dim twice


def _attention_problems(node, text_rows: int | None) -> list[str]:
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    where = node.meta["heads"].module if "heads" in node.meta else node.name
    problems = []
    for name, length in (("query", q.shape[-2]), ("key", k.shape[-2])):
        if length % BLOCK:
            fix = (" (or pad_sequence=True pads it exactly, at twice the attention cost)"
                   if pad_attention.paddable(node) else "")
            problems.append(f"{where}: {name} {sequence_length_advice(length, text_rows)}; otherwise the NKI flash "
                            f"kernel is not used and the whole score matrix is materialised{fix}")
            break
    if q.shape[-1] > MAX_HEAD_DIM:
        problems.append(f"{where}: head_dim {q.shape[-1]} > {MAX_HEAD_DIM}: the flash kernel is not used")
    mask, dropout, _ = pad_attention.attention_options(node)
    if mask is not None:
        problems.append(f"{where}: an attention mask (bias) disables the flash kernel")
    if dropout:
        problems.append(f"{where}: dropout {dropout} disables the flash kernel; run in eval mode")
    return problems


def legalize(gm: GraphModule, *, pad_sequence: bool = False) -> GraphModule:
    """A copy of this rank's graph rewritten as Neuron wants it: int64 indices narrowed to int32 where they provably
    fit, and with ``pad_sequence`` attention lengths padded exactly to multiples of 512. ``gm`` is left as it is."""
    gm = narrow_indices.run(copy_graph_module(gm))
    return pad_attention.run(gm, BLOCK) if pad_sequence else gm


def require_legal(gm: GraphModule, mesh, text_rows: int | None = None) -> None:
    problems = check(gm, mesh, text_rows)
    if problems:
        raise NeuronLegalityError("this rank's graph would fail or fall back on Neuron:\n  " + "\n  ".join(problems))


def check_offline(gm: GraphModule, mesh, *, pad_sequence: bool = False, text_rows: int | None = None) -> GraphModule:
    """The legalised graph, checked: what ``compile(backend="neuron", ...)`` would build, on any machine."""
    legal = legalize(gm, pad_sequence=pad_sequence)
    require_legal(legal, mesh, text_rows)
    return legal


def lower(gm: GraphModule, *, mesh, collectives=None, text_rows: int | None = None, pad_sequence: bool = False):
    """Legalize, check the rules, then compile with torch-neuronx (only on a host that has it). The callable takes
    the graph's inputs as they were (int64 indices included)."""
    del collectives
    gm = check_offline(gm, mesh, pad_sequence=pad_sequence, text_rows=text_rows)
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        raise BackendError("the graph passed every Neuron check, but torch-neuronx is not installed here; compile "
                           "on a Trainium host with torch-neuronx, or use partition(..., backend_checks='neuron') "
                           "to check layouts offline") from None
    return narrow_indices.cast_inputs(torch.compile(gm, backend="neuron"), gm)


register(Backend("neuron", "rank", lower, options=("pad_sequence", "text_rows"), check=check_offline))
