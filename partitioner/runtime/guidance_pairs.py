"""Classifier-free guidance on a cfg axis for pipelines that call their denoiser twice a step (conditional, then
unconditional: Wan, Qwen-Image, Flux's true CFG, HunyuanVideo, ...), with no per-pipeline code.

Such a call has a batch of 1, so a cfg axis has no rows to split. Instead the denoiser is partitioned with
``cfg="pairs"`` (its program replicated over the cfg axis; the other axes split it as usual within each half) and
``GuidancePairs`` serves its calls:

- It learns the step's call pattern from values: after two calls computed alike on every rank (a pair: first,
  second), a call is taken as the first of the next pair, and the second is predicted argument by argument: one that
  was equal in both calls of the last pair is taken from this call, one that differed from the last pair's second
  call (``predict``). Values are compared, never objects: pipelines pass a fresh ``timestep / 1000`` every call.
- Both calls run at once, the first on the cfg axis's first half, the prediction on its second
  (``PartitionedModule.call_pair``: every rank agrees on both calls together), and the outputs are exchanged over
  the cfg axis. The first call's output is returned, the second's held.
- The very next call is served the held output only if every argument equals the prediction, compared with a copy
  taken when it ran (an edit in place in between must not serve a stale result); otherwise the held output is
  dropped and the call computed; the pair is then learnt again from the call before and this one. A guidance scale
  of 1 (one call a step), a changing negative prompt, a third call a step, a new request: each only misses, and is
  computed as it would be without pairing.

A served output is bitwise the output of the same call computed alone: the same program ran on the same values, on
the other half of the axis. Ranks beyond the axis's first two coordinates (cfg > 2) compute nothing in a pair
(``PartitionWarning`` at the first call).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..errors import CollectiveTimeout, PartitionWarning
from .fingerprints import call_signature, leaf_key
from .gradients import wants_gradients
from .program import autocast_dtype
from .rank_groups import first_line, forget


def same_value(a, b) -> bool:
    """Whether two call arguments are equal in value: the same structure, tensors of the same shape, dtype, device
    and elements, plain values equal; any other object only itself (an unknown object may change anything)."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape \
                    or x.dtype != y.dtype or x.device != y.device or not torch.equal(_bits(x), _bits(y)):
                return False
        elif x is not y and not (isinstance(leaf_key(x), str) and leaf_key(x) == leaf_key(y)):
            return False  # (leaf_key is a repr only for plain values: numbers, strings, None, enums, dtypes)
    return True


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor's elements as integers of the same size: equal only where bitwise equal (-0.0 is not 0.0,
    which 1 / t tells apart; NaNs of the same bits are equal)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous()
    real = torch.view_as_real(flat) if flat.is_complex() else flat
    return real.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[real.element_size()])


def snapshot(named: dict) -> dict:
    """The arguments with every tensor copied: what a call was, whatever is later done to its tensors in place."""
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, named)


def predict(first: dict, second: dict, now: dict) -> dict:
    """The call expected after ``now``, from the last pair (``first``, ``second``): each argument that was equal in
    both calls of the pair is ``now``'s, each one that differed is ``second``'s."""
    return {name: value if name in first and name in second and same_value(first[name], second[name])
            else second.get(name, value) for name, value in now.items()}


@dataclass
class _Call:
    """A call as it was made: its arguments (copies) and the ``cache_context`` it was made in (diffusers pipelines
    name their guidance branches "cond" / "uncond"; None where a pipeline names none)."""
    named: dict
    context: str | None


@dataclass
class _Held:
    """A second call computed ahead: its predicted arguments (copied when it ran), its output, and the state it
    ran in (``GuidancePairs._state``)."""
    predicted: dict
    output: object
    state: tuple


def differing(first: dict, second: dict) -> int:
    """How many arguments of two calls differ in value."""
    return sum(not (name in second and same_value(value, second[name])) for name, value in first.items())


class GuidancePairs:
    """Serves ``module``'s calls (a ``PartitionedModule`` partitioned with ``cfg="pairs"``), two at once where the
    call pattern says a pair is coming. ``signature``: the model's forward signature (to compare calls argument by
    argument). ``calls``, ``paired`` and ``served`` count the calls, the pairs run and the second calls served.

    Which two consecutive calls make a pair: two that differ in no more arguments than the two calls before them did
    (the two calls of a step differ in the branch's inputs alone, two calls across steps also in the latents and the
    timestep), and where the pipeline names its branches (``cache_context``), in other branches. A call starts a
    pair unless it is the branch of the pair's second call (its name; or, unnamed, its value of an argument on which
    the pair differed is the second call's).
    """

    def __init__(self, module, signature: inspect.Signature, where: str):
        partitioned = module.partitioned
        self.module, self.signature, self.where = module, signature, where
        self.guard = partitioned.guard
        self.size = partitioned.mesh.size("cfg")
        self.coordinate = partitioned.mesh.coordinate("cfg")
        self.group = dist.distributed_c10d._resolve_process_group(partitioned.mesh.group_name("cfg"))
        self.pair: tuple[_Call, _Call] | None = None  # the last two calls taken for a pair
        self.last: _Call | None = None  # the last call made
        self.last_difference: int | None = None  # how many arguments it differed in from the call before it
        self.held: _Held | None = None
        self.calls = self.served = self.paired = 0
        if self.size > 2:
            warnings.warn(f"{where}: a cfg axis of {self.size} runs the two guidance calls of a step on its first two "
                          f"coordinates; the other {self.size - 2} compute nothing then (give those devices to tp or "
                          "ulysses)", PartitionWarning, stacklevel=3)

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs, None)

    def call(self, args: tuple, kwargs: dict, context: str | None):
        """The model's call ``(args, kwargs)``, made in the pipeline's ``cache_context`` ``context`` (or None)."""
        self.calls += 1
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        held, self.held = self.held, None
        state = self._state(named)
        if held is not None and held.state == state and all(
                name in held.predicted and same_value(value, held.predicted[name]) for name, value in named.items()):
            self._agree_served(named)
            self.served += 1
            self._observe(_Call(held.predicted, context))
            return held.output
        if held is None and state[-1] is False and self._starts_pair(named, context):
            predicted = snapshot(predict(self.pair[0].named, self.pair[1].named, named))
            call = inspect.BoundArguments(self.signature, predicted)  # back to positional and keyword arguments
            member = self.coordinate if self.coordinate < 2 else None
            with self.guard.exclusive():  # (where either call has no program, every rank ran the first alone)
                first, paired = self.module.call_pair((args, kwargs), (call.args, call.kwargs), member)
                if paired:
                    first, second = self._exchange(first)
            if paired:
                self.paired += 1
                self.held = _Held(predicted, second, state)
            self._observe(_Call(snapshot(named), context))
            return first
        output = self.module(*args, **kwargs)  # alone: learning the pattern, a miss, or a call recording gradients
        self._observe(_Call(snapshot(named), context))
        return output

    def _state(self, named: dict) -> tuple:
        """What a call's output depends on besides its arguments: the weights (their version), the module's mode,
        autocast; and whether the call records gradients (then it is never paired or served: the other half's
        output carries no autograd graph here)."""
        partitioned = self.module.partitioned
        trained = sum(parameter._version for parameter in partitioned.trained_parameters().values())  # (in place)
        return (partitioned.weights_version, trained, self.module.training,
                autocast_dtype(partitioned.mesh.device_type),
                wants_gradients(pytree.tree_leaves(named), partitioned.trainable))

    def _starts_pair(self, named: dict, context: str | None) -> bool:
        if self.pair is None:
            return False
        first, second = self.pair
        if context is not None and first.context is not None:
            return context == first.context
        return not any(not same_value(first.named[name], second.named[name]) and same_value(value, second.named[name])
                       for name, value in named.items() if name in first.named and name in second.named)

    def _observe(self, call: _Call) -> None:
        """Learn from a call made: it and the call before it are the pair, if they look like the two calls of a
        step."""
        if self.last is not None:
            difference = differing(self.last.named, call.named)
            alike = self.last_difference is None or difference <= self.last_difference
            if call.context is not None and self.last.context is not None:
                alike = alike and call.context != self.last.context  # two calls of one branch are no pair
            if alike:
                self.pair = (self.last, call)
            self.last_difference = difference
        self.last = call

    def _agree_served(self, named: dict) -> None:
        """Every rank serves this call, or every rank learns that one did not (its ranks would otherwise run a
        program the others skip): one agreement, as a computed call makes."""
        tensors = [(name, value) for name, value in named.items() if isinstance(value, torch.Tensor)]
        leaves, structure = pytree.tree_flatten(((), named))  # (as a computed call's: a rank whose prediction missed)
        with self.guard.exclusive():
            self.guard.agree(None, signature=call_signature(leaves, structure=structure), values=tensors,
                             marker="served by the guidance pair")

    def _exchange(self, mine):
        """The pair's two outputs on every rank: the first half's, then the second half's, broadcast over the cfg
        axis (their shapes and structure first)."""
        described = None if mine is None else pytree.tree_map(
            lambda v: _Described(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, mine)
        every = [None] * self.size
        try:
            dist.all_gather_object(every, described, group=self.group)
            outputs = []
            for source in (0, 1):
                if source == self.coordinate:
                    output = mine
                else:
                    output = pytree.tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device=self.guard.device)
                                             if isinstance(v, _Described) else v, every[source])
                for tensor in pytree.tree_leaves(output):
                    if isinstance(tensor, torch.Tensor):
                        dist.broadcast(tensor.contiguous() if source == self.coordinate else tensor,
                                       group=self.group, group_src=source)
                outputs.append(output)
        except RuntimeError as error:
            self.guard.broken = f"the guidance pair's exchange failed: {first_line(error)}"
            forget(self.guard.groups)
            raise CollectiveTimeout(f"{self.where}: the halves of the cfg axis did not exchange a guidance pair's "
                                    f"outputs within {self.guard.groups.timeout:g} s ({first_line(error)})") from error
        return outputs


@dataclass(frozen=True)
class _Described:
    """A tensor of the other half's output, by shape and dtype (sent before its elements)."""
    shape: tuple
    dtype: torch.dtype
