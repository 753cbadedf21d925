"""AWS Neuron (Trainium): the rules Neuron enforces, checked on a rank's graph on any CPU, then torch-neuronx.

Each rule says what fails on hardware and how to fix it, so a layout can be checked on a laptop before renting a
Trainium host. The rules (from torch-neuronx's documented behaviour and what was seen running MiniMax-H3):

- collectives: only all_reduce, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single exist;
- all-to-all groups: consecutive ranks (the mesh check already ensures it) of 4, 8, 16 or a multiple of 32 ranks;
- attention: query and key lengths multiples of 512, head_dim <= 128, no attention mask, no dropout, else
  torch-neuronx silently falls back from its NKI flash kernel to materialising the whole score matrix. That
  matters only where the matrix is too large for the core's on-chip memory (``SBUF_BYTES``): a smaller one (H3's
  178-row text refiner: 7 heads x 178 x 178 float32 is 0.85 MiB) compiles as a plain matmul and softmax, as it did
  on Trainium2. A larger one is tiled through HBM by the compiler, slower and with a compile time that grows with
  it: refused from a head's score size recorded to stall the compile (``STALL_BYTES``), a warning below it
  (unsure). The on-chip size is one physical NeuronCore's, though a trn2 rank (LNC=2) pairs two: conservative;
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

import re
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from ..errors import BackendError
from ..frontend.trace import copy_graph_module
from ..passes import narrow_indices, pad_attention
from ..passes.annotate_heads import module_path
from ..runtime import collectives
from .base import Backend, register
from ..annotations import annotation

_COLLECTIVES = {torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_gather_into_tensor.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default,
                torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.wait_tensor.default,
                *collectives.STARTS, *collectives.WAITS,
                collectives.sharded_rms_norm, collectives.sharded_layer_norm}
# Ops that move data to another device (creation ops are pointed at the rank's device when compiling).
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout}
BLOCK = 512  # sequence lengths the NKI flash-attention kernel accepts are multiples of this
MAX_HEAD_DIM = 128
# One NeuronCore-v3's on-chip SBUF: Trainium2 has 224 MiB of SBUF over its 8 cores (Neuron's Trainium2
# architecture page). Scores that fit stay on chip; larger ones are tiled through HBM by the compiler.
SBUF_BYTES = 224 * 2**20 // 8
# The smallest score matrix recorded to stall neuronx-cc, per head: full-size H3 at 37726 packed rows (the compile
# never finished; trimmed to 37376 or padded to 37888 it ran). A head's scores this large are refused.
STALL_BYTES = 37726 * 37726 * 4


class NeuronLegalityError(BackendError, ValueError):
    pass


class NeuronPerformanceWarning(UserWarning):
    """Legal, but the layout is likely to compile slowly or run far from the flash kernel's speed on Neuron."""


@dataclass(frozen=True)
class Finding:
    refuse: bool  # False: a warning (legal, but unsure or slow)
    problem: str
    where: str  # the module (or node) it applies to


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


def findings(gm: GraphModule, mesh, text_rows: int | None = None) -> list[Finding]:
    """Every way this rank's graph would fail (``refuse``) or run far from Neuron's fast path (a warning)."""
    found = []
    ulysses = mesh.size("ulysses")
    if ulysses > 1 and not valid_all_to_all_size(ulysses):
        valid = [n for n in (4, 8, 16, 32, 64) if n <= max(mesh.world_size, 4)]
        found.append(Finding(True, f"all-to-all over {ulysses} ranks: Neuron accepts groups of 4, 8, 16 or a "
                                   f"multiple of 32; use a ulysses degree of {valid}", "mesh"))
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        refuse = lambda problem: found.append(Finding(True, problem, _module_of(node)))  # noqa: E731
        if "_c10d_functional" in str(node.target) and node.target not in _COLLECTIVES:
            refuse(f"{node.target} is not a collective Neuron supports")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.dtype == torch.float64:
                refuse("float64 is not supported on Neuron; compute in float32")
            if any(not isinstance(size, int) for size in val.shape):
                refuse(f"dynamic shape {list(val.shape)}; Neuron compiles static shapes")
        device = node.kwargs.get("device")
        if node.target is torch.ops.aten.to.device and len(node.args) > 1:
            device = node.args[1]
        if (node.target in _COPIES and isinstance(device, torch.device) and device.type == "cpu"
                and isinstance(val, torch.Tensor) and val.dim()):
            refuse(f"copies a tensor {list(val.shape)} to the CPU inside the device graph; Neuron ops refuse "
                   "non-scalar CPU tensors (data-dependent work belongs in the host prologue)")
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            found += _attention_findings(node, text_rows)
        if node.target is collectives.halo_convolution:
            refuse("a convolution over rows split by a sequence axis is not lowered for Neuron yet (its halo "
                   "exchange sends all_to_all pieces of size zero to every rank but its neighbours); plan it "
                   "without the sequence axis or with tp only")
        if node.target is collectives.ring_attention:
            refuse("ring attention is not lowered for Neuron yet (it passes key/value blocks with all_to_all "
                   "pieces of size zero, which Neuron's all-to-all groups are not known to accept); use a ulysses "
                   "axis instead of ring")
    return found


def check(gm: GraphModule, mesh, text_rows: int | None = None) -> list[str]:
    """What would fail on Neuron, one line per distinct problem naming every module it affects (empty: legal)."""
    return grouped([f for f in findings(gm, mesh, text_rows) if f.refuse])


def grouped(found: list[Finding]) -> list[str]:
    """One line per distinct problem, with the modules it affects (``transformer_blocks.{0-49}.attn``)."""
    where = defaultdict(list)
    for finding in found:
        if finding.where not in where[finding.problem]:  # a padded attention's two calls: one module
            where[finding.problem].append(finding.where)
    return [problem if places == ["mesh"] else f"{problem} [in {_compress(places)}]"
            for problem, places in where.items()]


def _compress(names: list[str]) -> str:
    """``a.0.b``, ``a.1.b``, ``a.2.b`` -> ``a.{0-2}.b (3)``: names that differ only in one index, as ranges."""
    runs = defaultdict(list)
    for name in names:
        match = re.fullmatch(r"(.*?\.)(\d+)(\..*|)", name)
        key = (match.group(1), match.group(3)) if match else (name, None)
        runs[key].append(int(match.group(2)) if match else None)
    parts = []
    for (head, tail), indices in runs.items():
        indices = sorted(set(indices)) if tail is not None else indices
        if tail is None or len(indices) == 1:
            parts.append(head if tail is None else f"{head}{indices[0]}{tail}")
            continue
        spans, start = [], indices[0]
        for previous, index in zip(indices, indices[1:] + [None]):
            if index != previous + 1:
                spans.append(str(start) if start == previous else f"{start}-{previous}")
                start = index
        parts.append(f"{head}{{{','.join(spans)}}}{tail} ({len(indices)})")
    return ", ".join(parts)


def _attention_findings(node, text_rows: int | None) -> list[Finding]:
    """Why the flash kernel would not take this attention, and what that costs: nothing where the score matrix
    it materialises instead fits on chip, a warning where it is tiled through HBM, a refusal from the size recorded
    to stall the compile."""
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    blockers = []
    for name, length in (("query", q.shape[-2]), ("key", k.shape[-2])):
        if length % BLOCK:
            fix = (" (or pad_sequence=True pads it exactly, at twice the attention cost)"
                   if pad_attention.paddable(node) else "")
            blockers.append(f"{name} {sequence_length_advice(length, text_rows)}{fix}")
            break
    if q.shape[-1] > MAX_HEAD_DIM:
        blockers.append(f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    mask, dropout, _ = pad_attention.attention_options(node)
    if mask is not None:
        blockers.append("an attention mask (bias)")
    if dropout:
        blockers.append(f"dropout {dropout} (run in eval mode)")
    scores = q.shape[:-1].numel() * k.shape[-2] * 4  # float32 scores the fallback materialises
    if not blockers or scores <= SBUF_BYTES:
        return []
    shape = " x ".join(map(str, (*q.shape[:-1], k.shape[-2])))
    refuse = q.shape[-2] * k.shape[-2] * 4 >= STALL_BYTES  # one head's
    cost = (f"the float32 scores it materialises instead ({shape} = {_size(scores)}) exceed a NeuronCore's "
            f"{_size(SBUF_BYTES)} SBUF and are tiled through HBM: "
            + (f"at {_size(STALL_BYTES)} or more per head the compile was recorded never to finish" if refuse else
               "slower than the flash kernel, with a compile time that grows with them"))
    where = annotation(node).heads.module if annotation(node).heads is not None else _module_of(node)
    return [Finding(refuse, f"{blocker} keeps the NKI flash kernel from this attention; {cost}", where)
            for blocker in blockers]


def _module_of(node) -> str:
    return module_path(node) or node.name


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def legalize(gm: GraphModule, *, pad_sequence: bool = False) -> GraphModule:
    """A copy of this rank's graph rewritten as Neuron wants it: int64 indices narrowed to int32 where they provably
    fit, and with ``pad_sequence`` attention lengths padded exactly to multiples of 512. ``gm`` is left as it is."""
    gm = narrow_indices.run(copy_graph_module(gm))
    gm = pad_attention.run(gm, BLOCK) if pad_sequence else gm
    gm.recompile()  # (passes rewrite the graph only; its code is generated once they are done)
    return gm


def require_legal(gm: GraphModule, mesh, text_rows: int | None = None) -> None:
    """Raise for what would fail; warn (``NeuronPerformanceWarning``) for what is legal but slow or unsure."""
    found = findings(gm, mesh, text_rows)
    problems = grouped([f for f in found if f.refuse])
    if problems:
        raise NeuronLegalityError("this rank's graph would fail on Neuron:\n  " + "\n  ".join(problems))
    for warning in grouped(found):
        warnings.warn(warning, NeuronPerformanceWarning, stacklevel=3)


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
