"""The user API: ``partition(model, mesh, example_inputs)`` and ``Partitioned``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import backends
from .context import PassContext
from .dump import Dumper
from .mesh import as_mesh_spec
from .passes import PIPELINE
from .report import Report, build_report
from .runtime import CompiledPartition
from .trace import Traced, trace
from .weights import shard_state


class Partitioned:
    """One rank's partition of a model: its graph, its weight shards, and how both were derived."""

    def __init__(self, model_name: str, traced: Traced, ctx: PassContext):
        self.model_name = model_name
        self.traced = traced
        self.ctx = ctx
        self.graph_module = traced.graph_module
        tensor_names = [gi.target for gi in ctx.inputs if gi.kind != "user"]
        self.state = shard_state(traced.state, tensor_names, ctx.slice_specs, ctx.mesh)
        traced.state = {}  # the full tensors are the model's; keep only this rank's shards

    @property
    def mesh(self):
        return self.ctx.mesh

    @property
    def slice_specs(self) -> dict[str, dict]:
        """How each sharded parameter/buffer is cut: FQN -> {mesh axis: placement}."""
        return self.ctx.slice_specs

    @property
    def linear_styles(self) -> dict[str, str]:
        """The decision for every Linear: module path -> colwise / colwise packed [...] / rowwise / replicate."""
        return self.ctx.linear_styles

    def explain(self, module_path: str) -> str:
        """Why a Linear was planned the way it was."""
        style = self.ctx.linear_styles.get(module_path)
        if style is None:
            raise KeyError(f"no Linear at {module_path!r}")
        reason = self.ctx.replicated_because.get(module_path)
        return f"{module_path}: {style}" + (f" (column sharding stopped at {reason})" if reason else "")

    def report(self) -> Report:
        return build_report(self.graph_module, self.ctx)

    def compile(self, backend: str = "eager"):
        """A callable taking the model's forward arguments and returning what its forward returns."""
        if not self.mesh.runnable:
            raise RuntimeError(f"this partition was planned on axis sizes ({self.mesh}); to run it, partition with "
                               "a DeviceMesh on initialised process groups")
        meta = [name for name, t in self.state.items() if t.is_meta]
        if meta:
            raise RuntimeError(f"{len(meta)} tensors are on the meta device (e.g. {meta[0]!r}); the partition "
                               "needs real weights to run")
        tensor_inputs = [gi.target for gi in self.ctx.inputs if gi.kind != "user"]
        lowered = backends.get(backend)(self.graph_module, None)
        return CompiledPartition(lowered, self.traced, [self.state[name] for name in tensor_inputs],
                                 self.model_name)


def partition(model: torch.nn.Module, mesh, example_inputs, *, plan: dict[str, str] | None = None,
              dump_dir: str | Path | None = None, rank: int = 0) -> Partitioned:
    """Trace ``model`` on ``example_inputs = (args, kwargs)`` and rewrite it into this rank's program.

    ``mesh``: a DeviceMesh with dim names from {"tp"}, or axis sizes such as ``{"tp": 8}`` to plan without process
    groups (then ``rank`` picks which rank's program to build). ``plan``: overrides in diffusers' ``_tp_plan`` key
    syntax, e.g. ``{"transformer_blocks.*.attn.to_q": "colwise"}``. ``dump_dir`` (or ``$PARTITIONER_DUMP``): write
    the graph after every pass.
    """
    spec = as_mesh_spec(mesh, rank)
    traced = trace(model, example_inputs)
    ctx = PassContext(spec, traced.inputs, dict(plan or {}))
    dump = Dumper(dump_dir or os.environ.get("PARTITIONER_DUMP"))
    gm = traced.graph_module
    dump("export", gm, ctx)
    for name, run_pass in PIPELINE:
        gm = run_pass(gm, ctx)
        dump(name, gm, ctx)
    traced.graph_module = gm
    return Partitioned(type(model).__name__, traced, ctx)
