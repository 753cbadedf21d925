"""The Inductor backend: a rank's graph, collectives included, lowered through TorchInductor.

Regional compilation (the default): transformers repeat one block many times (H3: 50), and compiling the whole
graph costs time in proportion to its depth. The graph is cut at repeated-block boundaries (module paths ending in
a ModuleList index, ``transformer_blocks.7``); regions whose code is identical up to node names and whose inputs
have the same shapes are compiled once and the compiled code is reused for the others (their weights are inputs,
so one compiled block serves every block). The few regions around the blocks (embeddings, scatter, output heads)
run eagerly, or are compiled too with ``compile_glue=True``. With ``regional=False`` the whole graph is one
compilation.

Compilation happens at the first call, with that call's tensors as example inputs; later calls reuse it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from ..errors import BackendError, our_step
from ..passes.regions import repeated_block, runs_of_blocks
from ..progress import bar
from ..runtime.agreement import settle_pending, settle_point
from .base import Backend, register


@dataclass
class CompileStats:
    regions: int = 0  # parts the graph was cut into
    compilations: int = 0  # Inductor compilations actually run
    reused: dict[str, int] = field(default_factory=dict)  # structure key -> how many regions share it


def _region_ids(gm: GraphModule) -> dict[Node, int]:
    """Consecutive runs of nodes of one block (or of no block) form a region."""
    return {node: index for index, run in enumerate(runs_of_blocks(gm.graph.nodes)) for node in run}


def _structure_key(module: GraphModule, inputs) -> str:
    """Code of a region with names abstracted away, plus its input shapes, dtypes and strides."""
    index: dict[Node, int] = {}
    lines = []

    def ref(arg):
        return torch.fx.node.map_arg(arg, lambda n: f"%{index[n]}")

    for position, node in enumerate(module.graph.nodes):
        index[node] = position
        lines.append(f"{node.op} {node.target if node.op != 'placeholder' else ''} {ref(node.args)} {ref(node.kwargs)}")
    for value in inputs:
        lines.append(f"{tuple(value.shape)} {value.dtype} {value.stride()}" if isinstance(value, torch.Tensor)
                     else repr(value))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _compile(gm: GraphModule, args: list):
    """``compile_fx`` in a tracing context whose fake mode has a shape environment, as under ``torch.compile``:
    Inductor's FX graph cache keys its entries on it and bypasses any compilation without one, so that ranks and
    restarts compiling the same region read the compiled code from the cache (``TORCHINDUCTOR_CACHE_DIR``)
    instead of compiling it again. Shapes stay static (the example's), as under ``torch.compile``'s first
    compilation: the example inputs are given as fake tensors of static shapes. Given real tensors, AOTAutograd
    would fakify them with a symbol per size (the shape environment makes it), and Inductor would generate and
    simplify symbolic index expressions: measured 1.6x the compile time of the static region after a collective."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(mode)), torch._inductor.config.patch(**KEEP_COLLECTIVE_SCHEDULE):
        fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
        return compile_fx(gm, fakes)


# schedule_collectives has ordered the graph (issues early, waits late, within its own bound on the values held at
# once). Inductor's reordering for peak memory knows nothing of collectives: a wait frees its send buffer, so it
# runs each wait right after its issue and the exchange no longer overlaps anything (measured: Flux at Ulysses=2 on
# gloo, interleaved steps, 0.95 of the step with it on); fusion can pull a wait earlier too, which sink_waits undoes.
KEEP_COLLECTIVE_SCHEDULE = dict(reorder_for_peak_memory=False, reorder_for_compute_comm_overlap=True,
                                reorder_for_compute_comm_overlap_passes=["sink_waits"])


class _Interpreter(torch.fx.Interpreter):
    """Runs the split graph, compiling each block region at its first call (identical regions share one
    compilation); with ``compile_glue`` the regions between blocks are compiled too, else they run eagerly."""

    def __init__(self, split: GraphModule, stats: CompileStats, blocks: set[str], compile_glue: bool,
                 settled_from: set[str]):
        super().__init__(split)
        self.stats = stats
        self.settled_from = settled_from  # the regions from the agreement's settle point on: settled before them
        self.by_key: dict[str, object] = {}
        self.compiled: dict[str, object] = {}
        self.eager = set() if compile_glue else {n.target for n in split.graph.nodes
                                                  if n.op == "call_module" and n.target not in blocks}
        self.progress = None  # a bar over the regions to compile, shown during the first call

    def call_module(self, target, args, kwargs):
        if target in self.settled_from or (target not in self.compiled and target not in self.eager):
            try:  # (compiling waits for the agreement too: a refused call compiles nothing)
                settle_pending()
            except Exception:  # the agreement's refusal is the user's message, not a region's failure
                self.extra_traceback = False
                raise
        if target in self.eager:
            return super().call_module(target, args, kwargs)
        if target not in self.compiled:
            if self.progress is None:
                pending = [n for n in self.module.graph.nodes if n.op == "call_module" and n.target not in self.eager]
                self.progress = bar(desc="compiling (inductor)", total=len(pending), unit="region")
            submodule = self.fetch_attr(target)
            key = _structure_key(submodule, args)
            if key not in self.by_key:
                with our_step(f"lowering to backend 'inductor' ({target})", BackendError):  # at its first call
                    self.by_key[key] = _compile(submodule, list(args))
                self.stats.compilations += 1
            self.stats.reused[key] = self.stats.reused.get(key, 0) + 1
            self.compiled[target] = self.by_key[key]
            self.progress.update()
            if self.progress.n == self.progress.total:
                self.progress.close()
        return self.compiled[target](*args)


def lower(gm: GraphModule, *, mesh=None, collectives=None, regional: bool = True, compile_glue: bool = False):
    """A callable running ``gm`` compiled by Inductor; ``.stats`` says how many compilations it took."""
    del mesh, collectives  # the graph's collectives already name the mesh's process groups
    stats = CompileStats()
    if not regional:
        compiled = []

        def run_whole(*args):
            if not compiled:
                with our_step("lowering to backend 'inductor'", BackendError):  # at the first call
                    compiled.append(_compile(gm, list(args)))
                stats.regions = stats.compilations = 1
            return compiled[0](*args)

        run_whole.stats = stats
        return run_whole

    ids = _region_ids(gm)
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    stats.regions = sum(1 for n in split.graph.nodes if n.op == "call_module")
    blocks = {f"submod_{ids[node]}" for node in ids if repeated_block(node) is not None}
    point = settle_point(gm.graph.nodes)
    settled_from = {f"submod_{i}" for i in set(ids.values()) if point is not None and i >= ids[point]}
    interpreter = _Interpreter(split, stats, blocks, compile_glue, settled_from)

    def run_regions(*args):
        interpreter.extra_traceback = True
        return interpreter.run(*args)

    run_regions.stats = stats
    run_regions.settles_agreement = True  # (the regions ahead of the first collective overlap the agreement)
    return run_regions


def train(gm: GraphModule, *, regional: bool = True, compile_glue: bool = False):
    """The training copy of a rank program under ``torch.compile``: AOTAutograd derives its backward (the paired
    collectives' own) and Inductor compiles both, whole (regions are an inference-time saving)."""
    del regional, compile_glue
    eager_code = GraphModule(gm, gm.graph)  # (dynamo does not trace a lazily written GraphModule's forward)
    compiled = torch.compile(eager_code, backend="inductor", fullgraph=True, dynamic=False)
    first = []

    def run(*args):
        if first:
            return compiled(*args)
        with our_step("lowering the training copy to backend 'inductor'", BackendError):  # (compiles at this call)
            out = compiled(*args)
        first.append(True)
        return out

    return run


register(Backend("inductor", "rank", lower, options=("regional", "compile_glue"), train=train))
