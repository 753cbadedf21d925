"""The callable that ``lower`` returns: it starts XLA's runtime in SPMD mode (dumping HLO when it verifies), puts
inputs on the devices once, runs the annotated graph, and checks the first call's partitioned HLO against the plan.
torch_xla is imported only here, and only when a program is built: the package imports without it."""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx import GraphModule, Node

from ...frontend.trace import copy_graph_module
from ...mesh import MeshSpec
from ...passes.device_layout import place_graph_on
from .annotate import _annotate, _Annotator
from .errors import CollectiveMismatch, XlaBackendError
from .hlo import HloCollective, compare, hlo_collectives
from .layouts import Packed, _packed_placement, _packed_ranks
from ...annotations import annotation


def _torch_xla():
    try:
        import torch_xla  # noqa: F401
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as error:
        raise XlaBackendError(
            f"backend='xla' needs torch_xla, which is not importable here ({error}). torch_xla 2.9 needs exactly "
            f"torch==2.9.0 (this is torch {torch.__version__}): use a separate virtual environment, e.g. "
            "`make test` creates .venv-xla (see README, XLA SPMD)") from error
    return torch_xla, xs, xr


_OWN_DUMPS = "partitioner-xla-"  # prefix of the dump folder this backend makes when XLA_FLAGS names none


def _dump_dir() -> Path | None:
    match = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return Path(match.group(1)) if match else None


def _prepare_runtime(torch_xla, xr, mesh, verify) -> MeshSpec:
    """SPMD mode and (to verify) HLO dumps: XLA reads its flags once, when its runtime starts. Returns the mesh over
    all of XLA's devices: the plan's, behind a leading ``replicas`` axis over which everything is replicated when
    XLA has more devices than the plan (every group of consecutive devices runs the plan)."""
    started = torch_xla._XLAC._xla_runtime_is_initialized()
    if verify and _dump_dir() is None:
        if started:
            raise XlaBackendError("verify=True reads XLA's partitioned HLO, but the XLA runtime started without "
                                  "--xla_dump_to: set XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text' before "
                                  "the first XLA call, or compile with verify=False")
        flags = f"--xla_dump_to={tempfile.mkdtemp(prefix=_OWN_DUMPS)} --xla_dump_hlo_as_text"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    if not xr.is_spmd():
        xr.use_spmd()
    devices = xr.global_runtime_device_count()
    if devices % mesh.world_size:
        raise XlaBackendError(f"the mesh {mesh.sizes} has {mesh.world_size} devices, which do not divide XLA's "
                              f"{devices}; on CPU start with PJRT_DEVICE=CPU CPU_NUM_DEVICES={mesh.world_size}")
    if devices == mesh.world_size:
        return mesh
    return MeshSpec(("replicas",) + mesh.axis_names, (devices // mesh.world_size,) + mesh.axis_sizes, 0, None,
                    programs="global")


# XLA compiles a graph once per process and dumps it then: what its partitioned HLO held, by XLA's graph hash.
_PARTITIONED: dict[object, tuple[list[str], list[HloCollective]]] = {}


@dataclass
class XlaStats:
    collectives: list[HloCollective] = field(default_factory=list)  # in XLA's partitioned HLO (first call)
    mismatches: list[str] = field(default_factory=list)
    hlo_files: list[str] = field(default_factory=list)


class XlaProgram:
    """Takes the global graph's inputs as CPU tensors, returns its outputs as CPU tensors."""

    def __init__(self, planned: GraphModule, mesh, planned_collectives: Counter, verify):
        self.torch_xla, self.xs, self.xr = _torch_xla()
        mesh = _prepare_runtime(self.torch_xla, self.xr, mesh, verify)
        self.device = self.torch_xla.device()
        # device i of the mesh is XLA device i, so HLO replica groups read as mesh.groups(axis)
        self.xla_mesh = self.xs.Mesh(list(range(mesh.world_size)), mesh.axis_sizes, mesh.axis_names)
        self.gm = copy_graph_module(planned)
        place_graph_on(self.gm, self.device)
        self.mesh, self.planned_collectives, self.verify = mesh, planned_collectives, verify
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.stats = XlaStats()
        self.calls = 0
        self.placed: dict[int, tuple] = {}  # input index -> ((id, version) of the host tensor, device value, it)

    def _on_device(self, index: int, value, node: Node):
        """Input ``index`` on the XLA devices, sharded as its placements say. A tensor passed again unchanged (a
        weight: the same object, the same version) is reused, so weights move and are laid out once."""
        if not isinstance(value, torch.Tensor):
            return value
        key = (id(value), value._version)
        if self.placed.get(index, (None,))[0] == key:
            return self.placed[index][1]
        placements = (annotation(node).placements or {})
        packed = _packed_placement(placements, self.mesh)
        if packed is not None:  # laid out rank-major on the host, so the device never holds the fused layout
            dim, ranks = packed.dim % value.dim(), _packed_ranks(placements, self.mesh)
            host = Packed.from_blocks(value.split(list(packed.blocks), dim), dim, ranks)
            placed = Packed(host.tensor.to(self.device), dim, host.blocks)
        else:
            placed = value.to(self.device)
        placed = _annotate(placed, placements, self.xs, self.xla_mesh, self.mesh.axis_names, mark=True)
        self.placed[index] = (key, placed, value)  # holding value keeps its id from being reused
        return placed

    def __call__(self, *inputs):
        if len(inputs) != len(self.placeholders):
            raise XlaBackendError(f"expected {len(self.placeholders)} inputs, got {len(inputs)}")
        before = self._dumped() if self._verifying() else set()
        args = [self._on_device(i, value, node) for i, (value, node) in enumerate(zip(inputs, self.placeholders))]
        annotator = _Annotator(self.gm, self.xs, self.xla_mesh, self.mesh)
        with torch.no_grad():  # an inference graph: no autograd record on the XLA tensors
            outputs = annotator.run(*args)
        del annotator, args
        tensors = [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        graph_hash = self.torch_xla._XLAC._get_graph_hash(tensors) if self._verifying() else None
        self.torch_xla.sync()
        result = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, outputs)
        if self._verifying():
            new = self._dumped() - before
            try:
                self._verify(graph_hash, sorted(f for f in new if f.endswith("after_optimizations.txt")))
            finally:
                if _dump_dir().name.startswith(_OWN_DUMPS):  # ours: keep the HLO, not every kernel's IR (MBs)
                    for f in new:
                        if not f.endswith("optimizations.txt"):
                            Path(f).unlink(missing_ok=True)
        self.calls += 1
        return result

    def _verifying(self) -> bool:
        return bool(self.verify) and self.calls == 0

    def _dumped(self) -> set[str]:
        folder = _dump_dir()  # XLA creates a --xla_dump_to folder named by the user only when it first dumps
        return {str(p) for p in folder.iterdir()} if folder.is_dir() else set()

    def _verify(self, graph_hash, files: list[str]) -> None:
        if files:
            _PARTITIONED[graph_hash] = (files, [c for f in files for c in hlo_collectives(Path(f).read_text())])
        elif graph_hash not in _PARTITIONED:
            raise XlaBackendError(
                f"XLA compiled nothing new and dumped no partitioned HLO to {_dump_dir()}: it reused this graph, "
                "compiled earlier in this process without verify (or its runtime started before --xla_dump_to was "
                "set, or dumps only protos). Verify in a fresh process, or compile with verify=False")
        self.stats.hlo_files, self.stats.collectives = _PARTITIONED[graph_hash]
        self.stats.mismatches = compare(self.stats.collectives, self.planned_collectives, self.mesh)
        if self.stats.mismatches:
            message = ("XLA's partitioned HLO does not have the plan's collectives:\n  "
                       + "\n  ".join(self.stats.mismatches) + f"\n(HLO: {self.stats.hlo_files[-1]})")
            if self.verify == "warn":
                warnings.warn(message)
            else:
                raise CollectiveMismatch(message)

