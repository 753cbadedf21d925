"""Repeated blocks of a graph: the unit Inductor compiles once and reuses, and that the scheduler never reorders
nodes across (a node moved into another block's run would cut that block's region in two)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

_BLOCK = re.compile(r"\.\d+$")


def repeated_block(node: Node) -> str | None:
    """The outermost repeated block (a ModuleList child, ``transformer_blocks.7``) a node belongs to, if any."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if _BLOCK.search(path):
            return path
    return None


def runs_of_blocks(nodes) -> list[list[Node]]:
    """Consecutive runs of nodes of one repeated block (or of no block), placeholders and the output left out."""
    runs, key = [], object()
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        block = repeated_block(node)
        if block != key or not runs:
            runs.append([])
            key = block
        runs[-1].append(node)
    return runs


def propagate_fake_values(gm: GraphModule, mode: FakeTensorMode, inputs,
                          shape_of: Callable[[Node], tuple[int, ...]] | None = None) -> None:
    """``FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)``, each distinct repeated block propagated
    once: a block whose code (names abstracted away) and whose inputs' shapes, strides and dtypes equal a block's
    already propagated takes that block's values node for node. That is exact (fake-tensor ops are functions of
    their inputs' metadata) and turns 50 blocks of H3 into one. A block with data-dependent sizes or an op that
    writes its inputs is always propagated.

    An op whose output size depends on its inputs' values (``repeat_interleave`` by a tensor of repeats) had a
    static size at the trace only because those values were known then (constants, or inputs specialised under
    value guards): it keeps that size, or ``shape_of(node)`` where the caller knows better (localize: the global
    size cut by the node's placements)."""
    _RepeatedBlockProp(gm, mode, shape_of).propagate_dont_convert_inputs(*inputs)


# Python-level ops whose fake result is a fresh tensor that depends only on their arguments (tensors by metadata):
# ring attention loops over the ring's blocks (32 of them at ring=32), the planner's search propagates the same call
# for each cut and each block. Their results' metadata are kept here, by the call's metadata, for this process.
_METADATA_RESULTS: dict[tuple, tuple] = {}
_MEMO_LIMIT = 512


@functools.cache
def _memoized_targets() -> tuple:
    from ..runtime.collectives import ring_attention  # (imported late: runtime imports the passes' helpers)

    return (ring_attention,)


class _RepeatedBlockProp(FakeTensorProp):
    def __init__(self, gm: GraphModule, mode: FakeTensorMode, shape_of=None):
        super().__init__(gm, mode)
        self.shape_of = shape_of
        self.runs = {run[0]: run for run in runs_of_blocks(gm.graph.nodes) if repeated_block(run[0]) is not None}
        self.templates: dict[tuple, list[Node]] = {}  # (code, inputs' metadata) -> the block first propagated
        self.copy_from: dict[Node, Node] = {}

    def run_node(self, n: Node):
        if n in self.runs:
            self._match(self.runs[n])
        template = self.copy_from.pop(n, None)
        if template is None:
            if n.op == "call_function" and n.target in _memoized_targets():
                return self._memoized(n)
            traced = n.meta.get("val")
            try:
                return super().run_node(n)
            except DynamicOutputShapeException as error:
                return self._sized_by_values(n, traced, error)
        n.meta["val"] = template.meta["val"]
        return template.meta["val"]

    def _sized_by_values(self, n: Node, traced, error: Exception):
        shape = self.shape_of(n) if self.shape_of is not None else getattr(traced, "shape", None)
        if not isinstance(traced, torch.Tensor) or shape is None or not all(map(is_concrete_int, shape)):
            raise error
        with self._mode:
            result = torch.empty([int(size) for size in shape], dtype=traced.dtype, device=traced.device)
        n.meta["val"] = snapshot_fake(result)
        return result

    def _memoized(self, n: Node):
        """A memoized op's fake result: recreated from the metadata of an earlier call with the same arguments'
        metadata (a fresh tensor of that shape, stride, dtype and device), else computed and remembered."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        arguments = fake_metadata((*args, *kwargs.values()))  # None where a size is symbolic: never memoized
        key = (n.target, arguments, tuple(kwargs))
        known = _METADATA_RESULTS.get(key) if arguments is not None else None
        if known is None:
            result = super().run_node(n)
            meta = fake_metadata(result)
            if arguments is not None and isinstance(result, torch.Tensor) and meta is not None and meta[2] == 0:
                if len(_METADATA_RESULTS) >= _MEMO_LIMIT:
                    _METADATA_RESULTS.pop(next(iter(_METADATA_RESULTS)))
                _METADATA_RESULTS[key] = meta
            return result
        shape, stride, offset, dtype, device = known
        with self._mode:
            result = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        n.meta["val"] = snapshot_fake(result)
        return result

    def _match(self, run: list[Node]) -> None:
        code, external = code_of(run)
        inputs = tuple(fake_metadata(self.env[node]) for node in external)
        if None in inputs:
            return
        template = self.templates.setdefault((code, inputs), run)
        if template is not run and all(_static(node) for node in template):
            self.copy_from.update(zip(run, template))


def code_of(run: list[Node]) -> tuple[str, list[Node]]:
    """A run's code with its own nodes numbered by position and the values it reads from outside in order."""
    position = {node: index for index, node in enumerate(run)}
    external: dict[Node, int] = {}

    def ref(node: Node) -> str:
        return f"%{position[node]}" if node in position else f"${external.setdefault(node, len(external))}"

    lines = [f"{n.op} {n.target} {map_arg(n.args, ref)} {map_arg(n.kwargs, ref)}" for n in run]
    return "\n".join(lines), list(external)


def fake_metadata(value):
    """What a fake op's result depends on of an input: None when a size is symbolic."""
    if isinstance(value, torch.Tensor):
        if not all(isinstance(s, int) for s in (*value.shape, *value.stride(), value.storage_offset())):
            return None
        return tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device
    if isinstance(value, (tuple, list)):
        items = tuple(fake_metadata(v) for v in value)
        return None if None in items else items
    if isinstance(value, torch.SymInt):
        return None
    return repr(value)


def _static(node: Node) -> bool:
    """A node whose value a copy may take: no symbolic size, and its op writes none of its inputs."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return fake_metadata(node.meta.get("val")) is not None
