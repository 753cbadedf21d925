"""Calling a lowered rank graph with the model's own forward arguments, and returning what forward returns."""

from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.utils._pytree as pytree

from .trace import Traced, bind_forward


class InputError(ValueError):
    pass


def place_graph_on(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Point ops that create tensors (arange, zeros, ...) at ``device``: the trace baked in its own (meta, cpu)."""
    changed = False
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
            node.update_kwarg("device", device)
            changed = True
    if changed:
        gm.recompile()


class CompiledPartition:
    """``compiled(*args, **kwargs)`` flattens the forward arguments as at trace time, adds this rank's weight
    shards, runs the lowered graph and rebuilds the forward's output (tuple or output dataclass)."""

    def __init__(self, lowered: Callable, traced: Traced, state: list[torch.Tensor], owner: str, host=None):
        self.lowered = lowered
        self.host = host  # HostProgram: data-dependent ops run on the CPU before the device graph
        self.stats = getattr(lowered, "stats", None)  # compilation counts, for backends that compile
        self.traced = traced
        self.state = state  # this rank's tensors, in placeholder order
        self.device = state[0].device if state else torch.device("cpu")  # where this rank computes
        self.owner = owner
        self.user_index = [gi.target for gi in traced.inputs if gi.kind == "user"]
        placeholders = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        self.user_vals = [n.meta.get("val") for n, gi in zip(placeholders, traced.inputs) if gi.kind == "user"]

    def flatten(self, args, kwargs) -> tuple[list, list, bool | None]:
        """All flattened forward arguments, those the device graph takes, and the call's return_dict."""
        named = bind_forward(self.traced.signature, args, kwargs, self.owner, InputError)
        return_dict = named.get("return_dict")
        if "return_dict" in named:
            named["return_dict"] = True  # traced that way; converted back below
        leaves, spec = pytree.tree_flatten_with_path(((), named))
        flat = [leaf for _, leaf in leaves]
        names = [pytree.keystr(path[1:]) for path, _ in leaves]
        if spec != self.traced.in_spec:
            self._raise_structure_mismatch(named)
        for index, value in self.traced.constant_args.items():
            given = flat[index]
            if type(given) is not type(value) or given != value:
                raise InputError(f"{self.owner}: argument {names[index]}={given!r} differs from the traced "
                                 f"{value!r}; partition again with it in example_inputs")
        for index, expected in zip(self.user_index, self.user_vals):
            value = flat[index]
            if not isinstance(expected, torch.Tensor):
                continue
            if not isinstance(value, torch.Tensor):
                raise InputError(f"{self.owner}: {names[index]} must be a tensor (traced with one of shape "
                                 f"{list(expected.shape)}), got {type(value).__name__}")
            if tuple(value.shape) != tuple(expected.shape) or value.dtype != expected.dtype:
                raise InputError(f"{self.owner}: {names[index]} is {_tensor(value)}, traced with {_tensor(expected)}; "
                                 "this partition is static-shaped, partition again")
            if self.state and value.device != self.device:
                raise InputError(f"{self.owner}: {names[index]} is on {value.device}, this rank's weights on "
                                 f"{self.device}")
        return flat, [flat[i] for i in self.user_index], return_dict

    def _raise_structure_mismatch(self, named: dict) -> None:
        traced = pytree.tree_unflatten([object()] * self.traced.in_spec.num_leaves, self.traced.in_spec)[1]
        for name, value in named.items():
            given, expected = pytree.tree_structure(value), pytree.tree_structure(traced[name])
            if given != expected:
                raise InputError(f"{self.owner}: argument {name!r} has structure {_describe(value)}, traced with "
                                 f"{_describe(traced[name])}; partition again with it in example_inputs")
        raise InputError(f"{self.owner}: the arguments' structure differs from the traced one")

    def run_host(self, flat: list) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Run the prologue on the CPU and pad its results to the bounds the device graph was built for; also
        return this call's data-dependent sizes."""
        outputs = self.host.prologue(*(flat[i].cpu() for i in self.host.inputs))
        padded = []
        for value, transfer in zip(outputs, self.host.transfers):
            for dim, expression in transfer.sizes.items():
                if value.shape[dim] > transfer.shape[dim]:
                    raise InputError(
                        f"{self.owner}: {transfer.name} has {value.shape[dim]} entries along dim {dim} "
                        f"({expression}), more than the bound {transfer.shape[dim]} the partition was built for; raise "
                        f"it with torch._check({expression} <= k) in the model or partition(..., bounds=...)")
            full = value.new_zeros(transfer.shape)
            full[tuple(slice(0, size) for size in value.shape)] = value
            padded.append(full.to(self.device))
        return padded, self.host.sizes(outputs)

    def __call__(self, *args, **kwargs):
        flat, user, return_dict = self.flatten(args, kwargs)
        hosted, sizes = self.run_host(flat) if self.host is not None else ([], {})
        out = list(self.lowered(*self.state, *user, *hosted))
        for index, dim, expression in self.host.trims if self.host is not None else ():
            out[index] = out[index].narrow(dim, 0, int(sympy.sympify(expression).subs(sizes)))
        result = pytree.tree_unflatten(list(out), self.traced.out_spec)
        if return_dict is False and hasattr(result, "to_tuple"):
            return result.to_tuple()
        return result


def _describe(value) -> str:
    """A pytree's shape in a line: containers kept, leaves as *."""
    return str(pytree.tree_unflatten(["*"] * pytree.tree_structure(value).num_leaves, pytree.tree_structure(value)))


def _tensor(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
