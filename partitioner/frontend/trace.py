"""Trace a model with torch.export into an aten graph whose parameters and buffers are placeholders. The result
keeps what the passes and the runtime need and nothing of the ExportedProgram machinery: the GraphModule
(placeholders in export's order: parameters, buffers, constants, then user inputs), what each placeholder is, the
pytree specs of the forward's inputs and outputs, and the model's tensors by qualified name."""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch._prims_common import is_contiguous_or_false
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.numbers import int_oo

from ..errors import TraceError, our_step
from ..kinds import InputKind as GraphInputKind
from ..source import source_line
from ..tensor_parts import is_wrapped, plain_parts
from .meta_models import autocast_on_meta, buffers_on_meta, flex_attention_on_meta, inputs_on_meta, real_buffers_of
from .output_types import register_output_types
from .side_effects import attributes_kept
from .state_objects import StateWrite, register_state_objects, returning_writes
from .value_guards import Guards, ValueRead
from .value_specialization import ValueShadow, forward_replaced, model_line, shadowing_forward, shadowable
from ..annotations import annotation, copied_meta


@dataclass(frozen=True)
class GraphInput:
    """One placeholder: a model tensor (``kind`` parameter / buffer / constant, ``target`` its FQN), a user input
    (``kind`` user, ``target`` its index among the flattened forward arguments), or a value computed by the host
    prologue (``kind`` host, ``target`` its index among the prologue's outputs)."""
    kind: GraphInputKind
    target: str | int
    persistent: bool = True  # False for non-persistent buffers and constants: not in a checkpoint
    # A plain part of a tensor subclass (a quantised weight's payload or scales, ``tensor_parts``): the model
    # parameter it belongs to; ``target`` is that parameter's FQN and the part's attribute ("blocks.0.to_q.weight"
    # and "blocks.0.to_q.weight.qdata").
    part_of: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "kind", GraphInputKind(self.kind))

    @property
    def is_model_tensor(self) -> bool:
        return self.kind in (GraphInputKind.PARAMETER, GraphInputKind.BUFFER, GraphInputKind.CONSTANT)

    @property
    def model_name(self) -> str | int:
        """The model's own name for what this input holds: the parameter a part belongs to, else ``target``."""
        return self.part_of or self.target


@dataclass
class Traced:
    graph_module: torch.fx.GraphModule
    inputs: list[GraphInput]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    # Non-tensor leaves of the traced call (e.g. return_dict=True): export specialised on them.
    constant_args: dict[int, Any]
    state: dict[str, torch.Tensor] = field(repr=False)
    signature: inspect.Signature = field(repr=False)
    # Upper bounds of data-dependent sizes (from torch._check in the traced code): symbol name -> bound
    size_bounds: dict[str, int] = field(default_factory=dict)
    # Inputs whose values the graph is specialised on (value_specialization): flat index -> the value (CPU)
    values: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    value_reads: list[ValueRead] = field(default_factory=list)  # where the model read them
    values_specialized: bool = False  # traced with value specialisation (then every retrace is too)
    guards: Guards | None = None  # what it read of float inputs, replayed per call (value_guards)
    # State objects the forward writes into (a cache it fills): returned after its output, written back per call
    state_writes: tuple[StateWrite, ...] = ()


def argument_name(path: tuple) -> str:
    """A flattened forward argument's name from its pytree path: ``timestep``, ``image_rotary_emb[0]``."""
    if not path:
        return "argument"
    first, rest = path[0], path[1:]
    return str(getattr(first, "key", getattr(first, "idx", first))) + pytree.keystr(rest)


def bind_forward(signature: inspect.Signature, args, kwargs, owner: str, error=None) -> dict[str, Any]:
    """All forward arguments by name, defaults applied, in signature order; ``error`` (default TraceError) with a
    clear message when they do not fit. A ``**kwargs`` forward (every ``transformers`` model's) takes the extra
    names at the top level, as the call passed them, so export calls the model exactly so; values passed through a
    ``*args`` have no name to be traced or re-bound by, and are refused."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as problem:
        raise (error or TraceError)(f"the inputs do not match {owner}.forward{signature}: {problem}") from None
    bound.apply_defaults()
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise (error or TraceError)(
                    f"{owner}.forward takes *{name} and the call passes {len(value)} value(s) through it; partition "
                    "traces a call whose every argument has a name: pass them by keyword")
        else:
            named[name] = value
    return named


def _mutated_inputs(program) -> list[str]:
    """Graph inputs written in place (export keeps in-place ops such as ``add_`` in its non-functional IR)."""
    names = {spec.arg.name: spec.target or spec.arg.name for spec in program.graph_signature.input_specs}
    mutated = []
    for node in program.graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for argument, value in zip(schema.arguments, node.args):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, torch.fx.Node) and value.op == "placeholder":
                mutated.append(names.get(value.name, value.name))
    return mutated


def _writes_in_place(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [node for node in graph.nodes if node.op == "call_function"
            and getattr(getattr(node.target, "_schema", None), "is_mutable", False)]


def drop_in_place_detaches(graph: torch.fx.Graph) -> None:
    """``detach_`` writes no data: in a graph traced without autograd it is its input. transformers' key/value
    cache starts each layer from a fresh constant it detaches in place; left in, it would count as a write (and
    functionalizing it trips torch's check of such constants)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach_.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _reads_subclass_parts(graph: torch.fx.Graph) -> bool:
    """The graph takes a tensor subclass (a torchao quantised weight) whole and reads its parts inside."""
    return any(node.target is torch.ops.export.access_subclass_inner_tensor.default for node in graph.nodes
               if node.op == "call_function")


def functionalize(program, owner: str):
    """The program with every in-place write made explicit, when it has any. Export's IR keeps in-place ops on
    intermediate values (a RoPE written as ``q[..., n:] = rotate(...)`` is a ``copy_`` into a slice of q, with no
    user), invisible to the data flow the passes plan by: a collective after q would read q before the write.
    ``run_decompositions({})`` functionalizes (the ``copy_`` becomes a ``slice_scatter`` the attention reads) and
    decomposes nothing else. It also unwraps tensor subclasses (quantised weights) into their plain parts, which
    the passes place and the loader cuts like any parameter. Graphs without either are returned as they are (it
    rewrites views, and costs seconds)."""
    if not (_writes_in_place(program.graph_module.graph) or _reads_subclass_parts(program.graph_module.graph)):
        return program
    try:
        program = program.run_decompositions({})
    except Exception as error:  # functionalization raises many types; all mean the same to the user
        raise TraceError(f"{owner}: the traced graph writes in place and could not be functionalized: "
                         f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                         ) from error
    left = _writes_in_place(program.graph_module.graph)
    if left:  # a partition never runs a graph whose writes it cannot see
        raise TraceError(f"{owner}: in-place ops {sorted({str(n.target) for n in left})} remain after "
                         "functionalization; partition cannot place values that are written in place")
    return program


def subclass_part_names(model: torch.nn.Module, exported_names) -> dict[str, tuple[str, str]]:
    """Export's name of each plain part of a tensor-subclass parameter or buffer, under each name it has (tied
    weights: export keeps one; torch's parametrization names,
    ``<module>.parametrizations.<name>.original<i>``, in ``__tensor_flatten__`` order) -> (the part's name in the
    model's terms, ``<module>.<name>.<attribute>``, and the parameter's FQN). A name export did not use is left out."""
    names = {}
    for fqn, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if not is_wrapped(tensor):
            continue
        module, _, name = fqn.rpartition(".")
        prefix = f"{module}.parametrizations.{name}" if module else f"parametrizations.{name}"
        for index, (attribute, _) in enumerate(plain_parts(tensor)):
            if f"{prefix}.original{index}" in exported_names:
                names[f"{prefix}.original{index}"] = (f"{fqn}.{attribute}", fqn)
    return names


def _scaled_product(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """``baddbmm(input, a, b, beta=0, alpha)`` as ``alpha * bmm(a, b)``: the input it scales by zero (diffusers'
    classic attention allocates an empty one, of the scores' whole size) is never read, so never allocated."""
    added = node.args[0]
    with gm.graph.inserting_before(node):
        product = gm.graph.call_function(torch.ops.aten.bmm.default, tuple(node.args[1:3]))
        alpha = node.kwargs.get("alpha", 1)
        scaled = product if alpha == 1 else gm.graph.call_function(torch.ops.aten.mul.Tensor, (product, alpha))
    for new in {product, scaled}:
        new.meta = dict(node.meta)  # (same shape and dtype, same source line)
    node.replace_all_uses_with(scaled)
    gm.graph.erase_node(node)
    if isinstance(added, torch.fx.Node) and not added.users and added.op == "call_function":
        gm.graph.erase_node(added)


def _is_identity(node: torch.fx.Node, functional: bool) -> bool:
    """An eval-mode dropout, or a clone of a contiguous value into the same layout in a graph without writes."""
    source = node.args[0] if node.args else None
    if not isinstance(source, torch.fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return False
    if node.target is torch.ops.aten.dropout.default:
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        return train is False
    if node.target is torch.ops.aten.clone.default and functional and all(u.op != "output" for u in node.users):
        layout = node.kwargs.get("memory_format", torch.preserve_format)
        # Known without a guard: a size read from data (an unbacked symbol) leaves the clone in place.
        return layout in (torch.preserve_format, torch.contiguous_format) and _same_layout(source, node.meta.get("val"))
    return False


def _drop_empty_operands(gm: torch.fx.GraphModule, cat: torch.fx.Node, functional: bool) -> None:
    """Operands with no rows along the concatenated dim add nothing: a rotary applied to the first ``n`` rows
    concatenates the rest, ``x[n:]``, empty when ``n`` is the whole length (WanAnimate 2), and a slice that starts at
    the end of a sharded sequence has no local meaning. ``torch.cat`` also skips a 1-d operand with no elements
    whatever the others' rank (transformers' key/value cache starts each layer as ``torch.tensor([])``). Such
    operands are removed where the rest still give the result's dtype, and a concatenation of one value is that
    value (a copy only where the graph returns it or writes in place)."""
    out = cat.meta["val"]
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % max(out.dim(), 1)

    def empty(operand) -> bool:
        value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return False
        legacy = value.dim() == 1 and statically_known_true(value.shape[0] == 0)
        return legacy or (value.dim() == out.dim() and statically_known_true(value.shape[dim] == 0))
    operands = list(cat.args[0])
    kept = [operand for operand in operands if not empty(operand)]
    if len(kept) == len(operands) or not kept or out.dim() == 1:
        return
    if functools.reduce(torch.promote_types, [operand.meta["val"].dtype for operand in kept]) != out.dtype:
        return  # (a dropped operand decided the result's dtype)
    if len(kept) == 1 and functional and all(user.op != "output" for user in cat.users) and _same_layout(kept[0], out):
        cat.replace_all_uses_with(kept[0])
        gm.graph.erase_node(cat)
    else:  # (a concatenation of one value still copies it into the layout the ops after it were traced for)
        cat.args = (kept, *cat.args[1:])
    for operand in operands:
        if operand not in kept and isinstance(operand, torch.fx.Node) and not operand.users:
            _erase_unread(gm, operand)


def _same_layout(node: torch.fx.Node, copy) -> bool:
    """Whether ``node``'s value is contiguous and laid out as ``copy`` (a traced value) is, known without a guard:
    what follows a copy may view it (``view``, ``as_strided``) in the copy's layout."""
    mine = node.meta.get("val")
    return (isinstance(mine, torch.Tensor) and isinstance(copy, torch.Tensor) and is_contiguous_or_false(mine)
            and len(mine.stride()) == len(copy.stride())
            and all(statically_known_true(a == b) for a, b in zip(mine.stride(), copy.stride())))


_CAT_ALIASES = (torch.ops.aten.concatenate.default, torch.ops.aten.concat.default)
_MOVEDIM = (torch.ops.aten.movedim.int, torch.ops.aten.movedim.intlist)


def movedim_as_permute(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int]]:
    """``movedim(x, source, destination)`` as ``permute(x, dims)``: output dim ``d`` reads input dim ``dims[d]``."""
    x, source, destination = node.args[:3]
    rank = x.meta["val"].dim()
    source = [s % rank for s in (source if isinstance(source, (list, tuple)) else [source])]
    destination = [d % rank for d in (destination if isinstance(destination, (list, tuple)) else [destination])]
    dims = [-1] * rank
    for s, d in zip(source, destination):
        dims[d] = s
    rest = iter(i for i in range(rank) if i not in source)
    return x, [d if d != -1 else next(rest) for d in dims]


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _view_back(node: torch.fx.Node) -> bool:
    """A view of a view that gives back the first one's input's shape: that input itself."""
    source = node.args[0] if node.target in _VIEWS else None
    if not (isinstance(source, torch.fx.Node) and source.target in _VIEWS
            and isinstance(source.args[0], torch.fx.Node)):
        return False
    before, after = source.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    sizes = (*before.shape, *after.shape)  # (data-dependent sizes are never compared: that would guard on them)
    return all(isinstance(size, int) for size in sizes) and before.shape == after.shape


def clean_export_graph(gm: torch.fx.GraphModule) -> None:
    """Remove what export leaves that describes the trace rather than the model: ``_assert_tensor_metadata`` checks
    (they pin the trace-time device, meta or cpu); ``aten.to.dtype`` to the dtype a value has (H3 casts its rotary
    tables so in every block, and later blocks read the first block's cast: their code would differ); eval-mode
    dropouts, and clones that keep a contiguous value's layout in a graph without in-place writes (functionalization
    leaves one per dropout): copies the model never asked for (a clone the graph returns stays: the caller owns it).
    Ops export keeps under another name are given the one the rules know: ``concatenate`` and ``concat`` are
    ``cat``, ``movedim`` a ``permute``; a view straight back to its source's source's shape is that source's source
    (functionalization leaves a flatten and an unflatten around bias adds)."""
    functional = not _writes_in_place(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
        elif _is_identity(node, functional):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif (node.target is torch.ops.aten.to.dtype and len(node.args) == 2 and not node.kwargs
              and isinstance(node.args[0], torch.fx.Node) and node.args[0].meta["val"].dtype == node.args[1]):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten.cat.default:
            _drop_empty_operands(gm, node, functional)
        elif node.target in _CAT_ALIASES:  # torch.concatenate / torch.concat: cat by another name (LTX's VAEs)
            node.target = torch.ops.aten.cat.default
        elif node.target is torch.ops.aten.baddbmm.default and node.kwargs.get("beta", 1) == 0:
            _scaled_product(gm, node)
        elif node.target in _MOVEDIM:  # a view the rules know as permute (x.movedim(1, -1) before a norm)
            node.target, node.args, node.kwargs = torch.ops.aten.permute.default, movedim_as_permute(node), {}
        elif functional and _view_back(node):  # a flatten and its unflatten (functionalized bias adds leave them)
            first = node.args[0]
            node.replace_all_uses_with(first.args[0])
            gm.graph.erase_node(node)
            if not first.users:
                gm.graph.erase_node(first)
    gm.graph.lint()
    gm.recompile()


def inline_plain_autocast(gm: torch.fx.GraphModule, owner: str, on_meta: bool = False) -> None:
    """Inline the ``wrap_with_autocast`` regions that change no dtype: disabled ones (export keeps a region traced
    where autocast was off, e.g. Mochi's float32 rotary einsum on CPU) and those whose every floating value already
    has the autocast dtype (autocast casts nothing there). The passes see through their ops then; a region that
    does change dtypes stays opaque (and replicated). A model traced on the meta device had its autocast traced
    as the CPU's (``_MetaAutocastAsCpu``), which says nothing of the device it will run on: there only a float32
    region over float32 values is taken (autocast to float32 casts nothing on any device); any other is refused."""
    from torch._higher_order_ops.wrap import wrap_with_autocast

    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_autocast:
            continue
        _, dtype, enabled, _, body, *operands = node.args
        body = getattr(gm, body.target)
        values = [n.meta.get("val") for n in body.graph.nodes]
        floats = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if on_meta and (dtype != torch.float32 or any(v.dtype != dtype for v in floats)):
            raise TraceError(f"{owner}: an autocast region to {dtype} traced on the meta device ({source_line(node)}) "
                             "would cast as the device it runs on decides; trace the model on that device")
        if enabled and any(v.dtype != dtype for v in floats):
            continue
        env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], operands))
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "call_function":
                    env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
        results = [env[n] for n in torch.fx.node.map_arg(next(n for n in body.graph.nodes if n.op == "output")
                                                           .args[0], lambda n: n)]
        for user in list(node.users):
            if user.target is not operator.getitem:
                break
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        else:
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()


def _inline_constant_arguments(gm: torch.fx.GraphModule, inputs: list[GraphInput], constants: dict) -> list:
    """Non-tensor arguments (``return_dict=True``, ``attention_kwargs=None``) were specialised by export; their
    placeholders become the constants themselves, so the graph takes tensors only (compilers want that) and the
    runtime checks each call's constants against the traced ones."""
    kept = []
    for node, graph_input in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs):
        if graph_input.kind == "user" and graph_input.target in constants:
            value = constants[graph_input.target]
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda n: value if n is node else n)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda n: value if n is node else n)
            gm.graph.erase_node(node)
        else:
            kept.append(graph_input)
    gm.recompile()
    return kept


def slice_constant_runs(gm: torch.fx.GraphModule, inputs: list[GraphInput], state: dict) -> list[GraphInput]:
    """Rows picked by a constant index that is one ascending run (``x[:, :, idx]`` with ``idx`` = 0..5: Mochi's
    valid prompt rows, once value specialisation has folded ``nonzero(mask)``) are a slice: the same values, and a
    slice is what the sharding rules can carry over the whole blocks of a packed sequence. The index is computed
    from constants alone (``nonzero(...).flatten()``); what only it read, and constants left unread, are dropped."""
    aten = torch.ops.aten
    placeholders = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    values: dict = {}

    def value_of(node):
        """The value of a node computed from constants alone (deterministic ops), else None."""
        if not isinstance(node, torch.fx.Node):
            return node
        if node not in values:
            values[node] = None
            graph_input = placeholders.get(node)
            if graph_input is not None:
                value = state.get(graph_input.target) if graph_input.kind == "constant" else None
                values[node] = value.cpu() if value is not None and not value.is_meta else None
            elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                    node.all_input_nodes and torch.Tag.nondeterministic_seeded not in node.target.tags:
                args = [value_of(n) for n in node.all_input_nodes]
                if all(a is not None for a in args):
                    known = dict(zip(node.all_input_nodes, args))
                    get = lambda n: known[n]  # noqa: E731
                    # computed on the CPU (a constant moved to the model's device keeps its values here); an op that
                    # cannot run on the values leaves the index an index
                    kwargs = {k: torch.device("cpu") if k == "device" else v for k, v in node.kwargs.items()}
                    try:
                        value = node.target(*torch.fx.node.map_arg(node.args, get),
                                            **torch.fx.node.map_arg(kwargs, get))
                    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
                        value = None
                    values[node] = None if isinstance(value, torch.Tensor) and value.is_meta else value
        return values[node]

    def run_of(index) -> tuple[int, int] | None:
        value = value_of(index)
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or not len(value) or \
                value.is_floating_point() or value.dtype is torch.bool or int(value[0]) < 0:
            return None
        start = int(value[0])
        run = torch.arange(start, start + len(value), dtype=value.dtype)
        return (start, start + len(value)) if torch.equal(value.cpu(), run) else None

    for node in list(gm.graph.nodes):
        if node.target is aten.index.Tensor:
            picked = [(dim, index) for dim, index in enumerate(node.args[1]) if index is not None]
            where = picked[0] if len(picked) == 1 else None
        elif node.target is aten.index_select.default and node.args[0].meta["val"].dim():
            where = node.args[1] % node.args[0].meta["val"].dim(), node.args[2]
        else:
            continue
        bounds = run_of(where[1]) if where is not None else None
        if bounds is None or bounds[1] > node.args[0].meta["val"].shape[where[0]]:
            continue
        with gm.graph.inserting_before(node):
            sliced = gm.graph.call_function(aten.slice.Tensor, (node.args[0], where[0], *bounds))
        sliced.meta = copied_meta(node)
        node.replace_all_uses_with(sliced)
        gm.graph.erase_node(node)
        _erase_unread(gm, where[1])
    kept = []
    for node, graph_input in placeholders.items():
        if graph_input.kind == "constant" and not node.users:
            gm.graph.erase_node(node)
        else:
            kept.append(graph_input)
    gm.recompile()
    return kept


def _erase_unread(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then what only it read (placeholders are kept)."""
    if node.op == "placeholder" or node.users:
        return
    sources = node.all_input_nodes
    gm.graph.erase_node(node)
    for source in sources:
        _erase_unread(gm, source)


# What export takes as an input leaf (torch._export.non_strict_utils.fakify), and a little more: a leaf it does
# not take is refused by its own error.
_PLAIN_LEAVES = (torch.Tensor, int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
                 torch.memory_format, torch.layout, torch.SymInt, torch.SymFloat, torch.SymBool, torch.nn.Module,
                 torch.ScriptObject, enum.Enum)


try:
    from torch._library.opaque_object import is_opaque_value
except ImportError:  # (torch 2.9, torch_xla's: no opaque values)
    def is_opaque_value(value) -> bool:
        return False


def _is_plain(leaf) -> bool:
    return isinstance(leaf, _PLAIN_LEAVES) or is_opaque_value(leaf)


def _refuse_state_objects(leaves, owner: str) -> None:
    """An argument export cannot take (an object ``register_state_objects`` could not take apart, anything not a
    tensor, number, string or pytree container of them) is named, with what to do, before export fails on it
    without saying which."""
    for path, leaf in leaves:
        if _is_plain(leaf):
            continue
        name = argument_name(path[1:])
        raise TraceError(
            f"{owner}: argument {name!r} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which "
            "torch.export cannot take as an input (tensors, numbers, strings and lists, tuples, dicts or registered "
            "dataclasses of them only) and partition cannot take apart (an object is, by its attribute dict: this "
            f"one has none, or is callable). A cache or other state object: call without it ({name}=None, or "
            "use_cache=False where the forward offers it) to partition the uncached forward; or register its type "
            "with torch.utils._pytree.register_pytree_node so that its tensors become inputs")


def _export(model: torch.nn.Module, named: dict, owner: str, values: dict[str, torch.Tensor],
            real_buffers: dict[str, torch.Tensor], state_arguments: list[str]):
    """torch.export of ``model(**named)``; with ``values``, specialised on those arguments' values (by name);
    ``real_buffers`` traced as meta ones; what the forward writes into ``state_arguments`` returned after its
    output. Returns the program, the shadow (where the model read the values) and the state writes."""
    shadow = ValueShadow(type(model).__module__.split(".")[0])
    forward = shadowing_forward(model, shadow, values, argument_name) if values else model.forward
    writes: list[StateWrite] = []
    if state_arguments:
        forward = returning_writes(forward, state_arguments, writes, owner)
    replaced = forward_replaced(model, forward) if values or state_arguments else contextlib.nullcontext()
    try:
        # partitions are for inference: no autograd state in the graph (out= ops need it)
        with attributes_kept(model), replaced, autocast_on_meta(model), flex_attention_on_meta(model), \
                buffers_on_meta(model, real_buffers), torch.no_grad():
            return torch.export.export(model, (), kwargs=named), shadow, tuple(writes)
    except Exception as error:  # export raises many types; all mean the same to the user
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TraceError(
            f"torch.export could not trace {owner}: {type(error).__name__}: {first_line}\n"
            f"at the model's {_model_frame(error, model)}\n"
            "partition needs a model that torch.export.export(model, (), kwargs=...) accepts; see the chained "
            "exception for where tracing stopped."
        ) from error


def trace(model: torch.nn.Module, example_inputs, *, specialize_values: bool = False) -> Traced:
    """Export ``model`` called with ``example_inputs = (args, kwargs)``, keyword-normalised.

    A model that reads its inputs' values in Python is traced for this call's values (integer and boolean inputs
    pinned, float ones guarded) when it cannot be traced symbolically, or at once with ``specialize_values``, as
    ``partition`` asks when the host prologue cannot take a data-dependent size: see ``value_specialization``."""
    owner = type(model).__name__
    register_output_types()
    if not (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
            and isinstance(example_inputs[1], dict)):
        raise TraceError("example_inputs must be a pair (args, kwargs), e.g. ((), {'hidden_states': x, ...})")
    args, kwargs = example_inputs
    if not isinstance(args, (tuple, list)):
        raise TraceError(f"example_inputs[0] must be a tuple or list of positional arguments, got "
                         f"{type(args).__name__}; e.g. ((x,), {{}})")
    signature = inspect.signature(model.forward)
    named = bind_forward(signature, tuple(args), kwargs, owner)
    if "return_dict" in named:
        named["return_dict"] = True  # the runtime returns output.to_tuple() when a call asks for return_dict=False
    state_arguments = register_state_objects(named, _is_plain, owner)
    leaves = pytree.tree_flatten_with_path(((), named))[0]
    _refuse_state_objects(leaves, owner)
    names = [argument_name(path[1:]) for path, _ in leaves]
    values = {name: leaf for name, (_, leaf) in zip(names, leaves) if shadowable(leaf)}  # before meta below
    named = inputs_on_meta(model, named)
    real_buffers = real_buffers_of(model)
    try:
        program, shadow, writes = _export(model, named, owner, values if specialize_values else {}, real_buffers,
                                          state_arguments)
    except TraceError as error:
        if specialize_values or not values:
            raise
        try:  # the model may read its masks' values in Python: trace it for this call's
            program, shadow, writes = _export(model, named, owner, values, real_buffers, state_arguments)
        except TraceError as again:
            why = str(again).splitlines()[0].removeprefix(f"torch.export could not trace {owner}: ")
            raise TraceError(f"{error}\n(traced again for the values of {', '.join(values)}: {why})") \
                from error.__cause__
        specialize_values = True
    read_names = {name for read in shadow.reads for name in read.inputs}
    specialized = {names.index(name): values[name].detach().cpu().clone() for name in read_names}
    guards = Guards(shadow.tape, shadow.guards, {name: i for i, name in enumerate(names)}) if shadow.guards else None

    drop_in_place_detaches(program.graph_module.graph)
    gs = program.graph_signature
    mutated = [spec.target for spec in gs.output_specs if spec.kind != OutputKind.USER_OUTPUT]
    mutated += _mutated_inputs(program)
    if mutated:
        raise TraceError(f"{owner}.forward mutates {sorted(set(mutated))}; partition supports inference graphs "
                         "that do not write to their parameters, buffers or inputs")
    program = functionalize(program, owner)
    gs = program.graph_signature
    mutated = [spec.target for spec in gs.output_specs if spec.kind != OutputKind.USER_OUTPUT]
    if mutated:  # written through a view (``mask.mT.zero_()``): functionalization makes it an output
        raise TraceError(f"{owner}.forward mutates {sorted(set(mutated))} through a view; partition supports "
                         "inference graphs that do not write to their parameters, buffers or inputs")

    flat_args, in_spec = pytree.tree_flatten(((), named))
    constant_args = {i: leaf for i, leaf in enumerate(flat_args) if not isinstance(leaf, torch.Tensor)}
    parts = subclass_part_names(model, program.state_dict)
    state = {parts.get(name, (name,))[0]: tensor for name, tensor in program.state_dict.items()}
    # constants (tensors the model makes from literals, what value specialisation folded) live with the weights
    devices = {t.device for t in program.state_dict.values() if not t.is_meta}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    state.update({name: t.to(device) if isinstance(t, torch.Tensor) and not t.is_meta and device.type != "cpu"
                  else t for name, t in program.constants.items()})
    state.update({name: real for name, real in real_buffers.items() if name in state})  # (traced as meta)
    inputs, user_index = [], 0
    kinds = {InputKind.PARAMETER: GraphInputKind.PARAMETER, InputKind.BUFFER: GraphInputKind.BUFFER,
             InputKind.CONSTANT_TENSOR: GraphInputKind.CONSTANT}
    for spec in gs.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            # export lists every flattened leaf, constants included, in flattening order
            inputs.append(GraphInput(GraphInputKind.USER, user_index))
            user_index += 1
        elif spec.kind in kinds:
            persistent = spec.kind == InputKind.PARAMETER or bool(spec.persistent)
            target, part_of = parts.get(spec.target, (spec.target, None))
            inputs.append(GraphInput(kinds[spec.kind], target, persistent, part_of))
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind} for {spec.target}")
    gm = lazy_code(program.graph_module)
    with our_step("trace (the exported graph's clean-up)"):
        inline_plain_autocast(gm, owner, on_meta=any(p.is_meta for p in model.parameters()))
        clean_export_graph(gm)
        inputs = slice_constant_runs(gm, _inline_constant_arguments(gm, inputs, constant_args), state)
    bounds = {str(symbol): int(limits.upper) for symbol, limits in program.range_constraints.items()
              if limits.upper != int_oo}
    return Traced(gm, inputs, in_spec, program.call_spec.out_spec, constant_args, state, signature, bounds,
                  specialized, shadow.reads, specialize_values, guards, writes)


def _model_frame(error: BaseException, model: torch.nn.Module) -> str:
    """The innermost frame of ``error``'s traceback in the model's own package (diffusers' file and line), or in
    any file outside torch: where the model's code did what export refused."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return model_line(frames, type(model).__module__.split(".")[0]) or "code (no frame outside torch recorded)"


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph and node meta can be rewritten without touching ``gm``'s: meta that is keyed by
    nodes (an annotation's ``required``) is re-keyed to the copy's nodes; values (placements, fake tensors) are
    shared, as passes replace them rather than mutate them."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    mapping = dict(zip(gm.graph.nodes, graph.nodes))  # graph_copy keeps the order, output last
    for old, new in mapping.items():
        new.meta = copied_meta(old)  # (its annotation a copy: the two graphs' are rewritten apart)
        if annotation(old).required is not None:
            annotation(new).required = {axis: {mapping[node]: placement for node, placement in requirements.items()}
                                        for axis, requirements in annotation(old).required.items()}
    return lazy_code(gm, graph)


def lazy_code(root: torch.nn.Module, graph: torch.fx.Graph | None = None) -> torch.fx.GraphModule:
    """A GraphModule of ``graph`` (default: ``root``'s own) over ``root``'s submodules and attributes that writes its
    Python code when it is first run or read, not at every ``recompile()``. Passes rewrite a graph many times and
    run it through ``torch.fx.Interpreter`` only, and writing the code of a 50-block graph takes 0.2-0.3 s: PyTorch's
    ``_LazyGraphModule`` (which Inductor uses for the same reason) writes it once."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if graph is None and isinstance(root, _LazyGraphModule):
        return root
    return _LazyGraphModule(root, root.graph if graph is None else graph)
