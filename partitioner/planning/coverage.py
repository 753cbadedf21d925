"""How much of a model a layout splits, as typed values: the share of Linear weight bytes tensor-parallel, which
attentions run sequence-sharded, and each shortfall as a kind from a closed set (``Shortfall``), read from the
planning passes' decisions, never from their text. ``benchmarks/models.py`` writes docs/models.md from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..tensor_parts import stored_bytes
from ..decisions import AttentionSequencing, Style
from ..errors import PartitionerError, TraceError
from ..kinds import Kind

# tensor parallelism splits at least this share of Linear weight bytes, or the table says which stay whole
TP_TARGET = 0.9


class Shortfall(Kind):
    """Why a model under a layout is short of fully parallel (or not partitioned at all)."""
    NO_INPUT_BUILDER = "no input builder"  # nothing in the package builds its inputs as its pipeline does
    BUILD_FAILED = "build failed"  # the model or its inputs could not be made
    TRACE_REFUSED = "trace refused"  # a TraceError: torch.export, or a form partition does not trace
    REFUSED = "refused"  # another PartitionerError: a plan that cannot be exact
    FAILED = "failed"  # any other exception: a bug of this package
    INEXACT = "inexact"  # partitioned, but a rank's output differs from the model's (never expected)
    AXIS_IDLE = "axis splits nothing"  # a sequence axis shards no value
    ATTENTION_WHOLE = "attention whole"  # some attention's rows not split over a sequence axis
    LINEARS_WHOLE = "linears whole"  # tensor parallelism splits less than TP_TARGET of the Linear weight bytes


@dataclass(frozen=True)
class Coverage:
    mesh: dict[str, int]
    linear_bytes: int = 0
    sharded_linear_bytes: int = 0
    whole_linears: tuple[str, ...] = ()  # the Linears (module paths) left whole, largest first
    whole_because: dict[str, str] = field(default_factory=dict)  # a whole Linear -> where column sharding stopped
    attentions: dict[str, AttentionSequencing] = field(default_factory=dict)
    idle_axes: tuple[str, ...] = ()
    shortfalls: tuple[Shortfall, ...] = ()
    error: str = ""  # the refusal's first line, when planning refused

    @property
    def tp_share(self) -> float | None:
        """The share of Linear weight bytes split over tp (None without a tp axis or Linears)."""
        if self.mesh.get("tp", 1) <= 1 or not self.linear_bytes:
            return None
        return self.sharded_linear_bytes / self.linear_bytes

    @property
    def attentions_sharded(self) -> tuple[int, int]:
        """(attentions whose rows are split over every sequence axis, attentions with rows to split)."""
        counted = [decided for decided in self.attentions.values() if not decided.single_query]
        return sum(decided.sharded for decided in counted), len(counted)

    @property
    def status(self) -> str:
        """ok (fully parallel), partial (partitioned, short of full), refused."""
        if self.error or any(s in _REFUSALS for s in self.shortfalls):
            return "refused"
        return "partial" if self.shortfalls else "ok"


_REFUSALS = (Shortfall.NO_INPUT_BUILDER, Shortfall.BUILD_FAILED, Shortfall.TRACE_REFUSED, Shortfall.REFUSED,
             Shortfall.FAILED, Shortfall.INEXACT)


def refusal(mesh: dict[str, int], error: BaseException) -> Coverage:
    """The coverage of a layout whose planning raised ``error``."""
    kind = (Shortfall.TRACE_REFUSED if isinstance(error, TraceError) else Shortfall.REFUSED
            if isinstance(error, PartitionerError) else Shortfall.FAILED)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return Coverage(dict(mesh), shortfalls=(kind,), error=f"{type(error).__name__}: {first}"[:300])


def coverage(model: torch.nn.Module, mesh: dict[str, int], example_inputs, **options) -> Coverage:
    """Plan ``model`` for a mesh of axis sizes (no process group, no weights needed) and measure what it splits;
    a refusal is a ``Coverage`` with its kind and message, never an exception."""
    from ..api import planned

    try:
        ctx = planned(model, mesh, example_inputs, **options)
    except Exception as error:  # noqa: BLE001  (a survey: every outcome is a row)
        return refusal(mesh, error)
    sizes = {}
    for path, decided in ctx.linear_styles.items():
        try:  # (a functional F.linear outside any module is named by its node: its weight is not counted)
            weight = getattr(model.get_submodule(path), "weight", None)
        except AttributeError:
            weight = None
        sizes[path] = (stored_bytes(weight) if isinstance(weight, torch.Tensor) else 0,
                       decided.style is not Style.REPLICATE)
    total = sum(size for size, _ in sizes.values())
    sharded = sum(size for size, split in sizes.values() if split)
    whole = tuple(path for path, (size, split) in sorted(sizes.items(), key=lambda item: -item[1][0])
                  if not split) if mesh.get("tp", 1) > 1 else ()
    shortfalls = []
    if ctx.sequence_idle:
        shortfalls.append(Shortfall.AXIS_IDLE)
    if ctx.sequence_whole:
        shortfalls.append(Shortfall.ATTENTION_WHOLE)
    because = {path: str(ctx.replicated_because[path]) for path in whole if path in ctx.replicated_because}
    result = Coverage(dict(mesh), total, sharded, whole, because, dict(ctx.sequence_attention),
                      tuple(ctx.sequence_idle))
    if result.tp_share is not None and result.tp_share < TP_TARGET:
        shortfalls.append(Shortfall.LINEARS_WHOLE)
    return dataclasses.replace(result, shortfalls=tuple(shortfalls))
