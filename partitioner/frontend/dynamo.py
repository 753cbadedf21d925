"""The torch.compile frontend: ``torch.compile(model, backend="partitioner", options={"mesh": mesh, ...})``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so it resolves after a plain
install without importing this package first. Options: ``mesh`` (required: a DeviceMesh, or axis sizes for
"xla"), ``backend`` ("eager", "inductor" or "xla", default "eager"), ``plan`` (``_tp_plan``-style overrides),
``dump_dir``, ``compile_options`` (for the inner backend, e.g. ``{"regional": False}``), ``timeout`` (seconds,
bounding every collective; ranks compare plans and agree on every call as ``partition`` does).

Dynamo hands over each captured graph with the model's parameters and buffers lifted as inputs. The backend
exports it to aten, runs the partitioner's passes on it, keeps this rank's slices of the parameters and drops
every reference to the full ones: later calls still pass the full parameters (they belong to the model), and they
are ignored. Graph breaks: every captured graph is partitioned on its own, and a graph's outputs are always whole
(replicated) tensors, so each break costs the collectives that make its outputs whole, and Python code between
graphs sees ordinary tensors.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from torch.export.graph_signature import InputKind

from ..errors import InputError
from ..kinds import InputKind as GraphInputKind
from ..runtime.rank_groups import DEFAULT_TIMEOUT
from ..runtime.fingerprints import call_signature, check_fingerprint
from ..runtime.gradients import frontend_reason, marked_to_train, refusing_backward, wants_gradients
from .trace import GraphInput, Traced, TraceError, clean_export_graph, functionalize

_KEY = re.compile(r"\['([^']+)'\]")
_CONTAINERS = {"_modules", "_parameters", "_buffers"}
_OPTIONS = {"mesh", "backend", "plan", "dump_dir", "compile_options", "timeout", "overlap", "input_fingerprint"}


def _graph_inputs(gm: torch.fx.GraphModule, example_inputs) -> list[GraphInput]:
    """Which of dynamo's graph inputs are the model's parameters and buffers (by their source), and their FQNs."""
    inputs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and hasattr(grapharg.source, "name") else ""
        source = source() if callable(source) else source
        # L['self'].__dict__['_modules']['rope']._buffers['inv_freq'] -> rope.inv_freq
        keys = _KEY.findall(source)
        fqn = ".".join(k for k in keys[1:] if k not in _CONTAINERS) if source.startswith("L[") else ""
        if isinstance(value, torch.nn.Parameter) and fqn:
            inputs.append(GraphInput(GraphInputKind.PARAMETER, fqn))
        elif "_buffers[" in source and fqn:
            inputs.append(GraphInput(GraphInputKind.BUFFER, fqn))
        else:
            inputs.append(GraphInput(GraphInputKind.USER, position))
    return inputs


def partitioner_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    options = dict(options or {})
    unknown = set(options) - _OPTIONS
    if unknown or "mesh" not in options:
        raise InputError(f"backend='partitioner' takes options {sorted(_OPTIONS)} with 'mesh' required; "
                         f"got {sorted(options)}")
    from ..api import mesh_with_groups
    from ..build import build_agreed, partition_traced
    from ..runtime.preflight import Preflight

    from .. import backends

    # the inner backend names the program: XLA's one global program, or one per rank
    programs = backends.get(options.get("backend", "eager")).takes
    mesh, groups = mesh_with_groups(options["mesh"], 0, options.get("timeout", DEFAULT_TIMEOUT), programs)
    dynamo_inputs = _graph_inputs(gm, example_inputs)
    build = functools.partial(_partition, gm, example_inputs, dynamo_inputs, mesh, options, partition_traced)
    partitioned = build_agreed(build, mesh, groups, {"plan": options.get("plan"),
                                                                  "overlap": options.get("overlap", True)})
    inputs = partitioned.ctx.inputs
    lowered, tensors = partitioned.lower(options.get("backend", "eager"), **options.get("compile_options", {}))
    tensors = dict(zip([gi.target for gi in inputs if gi.is_model_tensor], tensors()))
    # dynamo interleaves parameters and activations: per graph input, this rank's shard or the call's argument
    sources = [(None, tensors[gi.target]) if gi.kind != "user" else (gi.target, None) for gi in inputs]
    # weights marked to train: dynamo hands the model's own parameters in as inputs
    trainable = marked_to_train([value.requires_grad for (position, _), value in zip(sources, example_inputs)
                                 if position is None and isinstance(value, torch.Tensor)], gm.training)
    del example_inputs, tensors, build  # keep no reference to the full parameters (but XLA's, which it runs)
    preflight = Preflight(partitioned.planned_graph, inputs, [f"input {i}" for i in range(len(sources))])
    guard = partitioned.guard
    guard.fingerprint = check_fingerprint(options.get("input_fingerprint", "sample"))

    reason = frontend_reason(type(gm).__name__)

    def run(*args):
        with guard.exclusive():
            problem = None
            try:  # index checks before the first collective, agreed by every rank
                preflight.check(list(args), [])
            except InputError as error:
                problem = error
            guard.agree(problem, call_signature(list(args)), values=[
                (f"input {position}", args[position]) for position, _ in sources
                if position is not None and isinstance(args[position], torch.Tensor)])
            users = [args[position] for position, _ in sources if position is not None]
            gradients = wants_gradients(users, trainable)
            with guard.running([partitioned.graph_module, lowered]), torch.no_grad():
                out = lowered(*(value if position is None else args[position] for position, value in sources))
            return type(out)(refusing_backward(list(out), users, reason)) if gradients else out

    run.partitioned = partitioned
    return run


def _partition(gm, example_inputs, dynamo_inputs, mesh, options, partition_traced):
    try:
        program = torch.export.export(gm, tuple(example_inputs), strict=False)
    except Exception as error:
        raise TraceError(f"torch.export could not trace a graph captured by dynamo: {error}") from error
    program = functionalize(program, "a graph captured by dynamo")
    inputs, state, user_index = [], dict(program.state_dict), 0
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            graph_input = dynamo_inputs[user_index]
            if graph_input.kind != "user":
                state[graph_input.target] = example_inputs[user_index]
            inputs.append(graph_input)
            user_index += 1
        else:
            kind = {InputKind.PARAMETER: GraphInputKind.PARAMETER,
                    InputKind.BUFFER: GraphInputKind.BUFFER}.get(spec.kind, GraphInputKind.CONSTANT)
            inputs.append(GraphInput(kind, spec.target))
            state.setdefault(spec.target, program.constants.get(spec.target))
    graph = program.graph_module
    clean_export_graph(graph)
    traced = Traced(graph, inputs, program.call_spec.in_spec, program.call_spec.out_spec, {}, state,
                    inspect.signature(gm.forward))
    return partition_traced(traced, mesh, type(gm).__name__, plan=options.get("plan"),
                            dump_dir=options.get("dump_dir"), overlap=options.get("overlap", True))
