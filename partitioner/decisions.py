"""What the planning passes decide, as typed values.

Passes produce these values and passes, the runtime and ``Plan`` consume them; text is only their ``__str__`` (what
``explain()`` and the reports print), and nothing reads a decision back from its text. A ``Plan`` saves the
decisions that are applied (``LinearSharding``, ``SequenceSeed``) as JSON fields, never as prose.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InputError
from .kinds import Kind


class Style(Kind):
    """How a Linear is split over the tensor axis (diffusers' ``_tp_plan`` names)."""
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    REPLICATE = "replicate"


@dataclass(frozen=True)
class LinearSharding:
    """A Linear over the tensor axis. ``blocks``: a packed column shard's blocks (each split on its own), in output
    columns; ``unit``: the number of columns a column shard splits in whole multiples of (a head's width, ...);
    ``widths``: the narrowest and widest rank's share when the columns split unevenly (derived: not applied);
    ``gathered``: a forced column shard whose consumers cannot carry it, gathered right after the Linear."""
    style: Style
    blocks: tuple[int, ...] | None = None
    unit: int = 1
    widths: tuple[int, int] | None = None
    gathered: bool = False

    def __str__(self) -> str:
        text = self.style.value + (f" packed {list(self.blocks)}" if self.blocks else "")
        if self.widths is not None and self.widths[0] != self.widths[1]:
            text += f" uneven {self.widths[0]}-{self.widths[1]}"
        return text + (f" in units of {self.unit}" if self.unit > 1 else "") + (" gathered" if self.gathered else "")

    @classmethod
    def of(cls, value, where: str) -> "LinearSharding":
        """A plan entry as a decision: a ``LinearSharding``, or one of the style names ("colwise", "rowwise",
        "replicate"); ``InputError`` naming ``where`` otherwise, or for a unit or block of 0."""
        if isinstance(value, str) and not isinstance(value, Style):
            if value not in {s.value for s in Style}:
                raise InputError(f"plan entry {where!r}: style {value!r} is not one of {[s.value for s in Style]}; "
                                 "give packed blocks or units as LinearSharding(style, blocks=..., unit=...)")
            value = cls(Style(value))
        elif isinstance(value, Style):
            value = cls(value)
        if not isinstance(value, LinearSharding):
            raise InputError(f"plan entry {where!r}: {type(value).__name__} is not a LinearSharding or a style name")
        style = value.style
        if not isinstance(style, Style):
            style = cls.of(style, where).style if isinstance(style, str) else None
        blocks, widths = _whole_numbers(value.blocks), _whole_numbers(value.widths)
        if (style is None or blocks is False or widths is False or type(value.unit) is not int
                or (widths is not None and len(widths) != 2) or type(value.gathered) is not bool):
            raise InputError(f"plan entry {where!r}: {value!r} is not a Linear decision: LinearSharding(style: Style, "
                             "blocks: None or (columns, ...), unit: columns, widths: None, gathered: False)")
        if value.unit < 1 or (blocks is not None and (not blocks or min(blocks) < 1)):
            raise InputError(f"plan entry {where!r}: {value!r} has a unit or block below 1; units and packed blocks "
                             "are positive numbers of columns")
        return cls(style, blocks, value.unit, widths, value.gathered)

    def applied(self) -> dict:
        """What applying this decision takes (``widths`` and ``gathered`` are derived again): what is hashed."""
        return {"style": self.style.value, "blocks": list(self.blocks) if self.blocks else None, "unit": self.unit}

    def as_json(self) -> dict:
        return {**self.applied(), "widths": list(self.widths) if self.widths else None, "gathered": self.gathered}

    @classmethod
    def from_json(cls, data, where: str) -> "LinearSharding":
        if isinstance(data, str):  # a style name, as an edit may write it
            return cls.of(data, where)

        def numbers(value, count=None) -> bool:
            return value is None or (isinstance(value, list) and all(type(v) is int for v in value)
                                     and (count is None or len(value) == count))

        if not (isinstance(data, dict) and set(data) <= {"style", "blocks", "unit", "widths", "gathered"}
                and isinstance(data.get("style"), str) and data["style"] in {s.value for s in Style}
                and type(data.get("unit", 1)) is int and isinstance(data.get("gathered", False), bool)
                and numbers(data.get("blocks"))
                and numbers(data.get("widths"), 2)):
            raise InputError(f"plan entry {where!r}: {data!r} is not a Linear decision: an object "
                             "{\"style\": colwise | rowwise | replicate, \"blocks\": null or [columns, ...], "
                             "\"unit\": columns, \"gathered\": false}")
        blocks = tuple(data["blocks"]) if data.get("blocks") else None
        widths = tuple(data["widths"]) if data.get("widths") else None
        return cls.of(cls(Style(data["style"]), blocks, data.get("unit", 1), widths, data.get("gathered", False)),
                      where)


def _whole_numbers(values) -> tuple[int, ...] | None | bool:
    """``values`` as a tuple of ints; None for None; False where it is not a sequence of ints."""
    if values is None:
        return None
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        return tuple(values)
    return False


# the deepest a value key looks at its producers (``passes/value_keys.py``)
MAX_KEY_DEPTH = 12


@dataclass(frozen=True)
class ValueKey:
    """Where a value is in the model, stable across traces (``passes/value_keys.py``): the module that computes it,
    its op and its local signature (its operands' roles); ``digest``: its producers' structure ``depth`` levels up;
    ``twin`` of ``alike``: its place among the values of the same module, op and local signature. Node names are
    not part of it: they shift when an op is added anywhere before."""
    module: str
    op: str
    signature: str
    digest: str
    depth: int
    twin: int
    alike: int

    def __str__(self) -> str:
        place = f" (#{self.twin + 1} of {self.alike} alike)" if self.alike > 1 else ""
        return f"{self.op} in {self.module or 'the model itself'}{place}"

    def as_json(self) -> dict:
        return {"module": self.module, "op": self.op, "signature": self.signature, "digest": self.digest,
                "depth": self.depth, "twin": self.twin, "alike": self.alike}


@dataclass(frozen=True)
class SequenceSeed:
    """Where the sequence sharding of one axis starts: the value (by key) and its dim that holds the rows."""
    key: ValueKey
    dim: int

    def __str__(self) -> str:
        return f"{self.key}, dim {self.dim}"

    def as_json(self) -> dict:
        return {**self.key.as_json(), "dim": self.dim}

    @classmethod
    def from_json(cls, data, where: str) -> "SequenceSeed":
        fields = {"module": str, "op": str, "signature": str, "digest": str, "depth": int, "twin": int, "alike": int,
                  "dim": int}
        if not (isinstance(data, dict) and set(data) == set(fields)
                and all(isinstance(data[k], kind) and not isinstance(data[k], bool) for k, kind in fields.items())):
            raise InputError(f"{where}: {data!r} is not a sequence seed: an object with {sorted(fields)}")
        if not (0 <= data["twin"] < data["alike"] and 0 <= data["depth"] <= MAX_KEY_DEPTH):
            raise InputError(f"{where}: twin {data['twin']} of {data['alike']} alike at depth {data['depth']}: a "
                             f"seed is one of the values alike (0 <= twin < alike) at a depth of 0 to {MAX_KEY_DEPTH}")
        return cls(ValueKey(*(data[k] for k in fields if k != "dim")), data["dim"])


class SequenceKind(enum.Enum):
    """How an attention runs over a sequence axis."""
    ULYSSES = "sequence-sharded (Ulysses all_to_all)"
    RING = "sequence-sharded (ring attention: key/value blocks passed round the ring)"
    QUERY_ROWS = "sequence-sharded (query rows; keys and values whole, no communication)"
    # (the sequence split along what this attention folds into its batch: frames, for attention within each frame)
    BATCH = ("sequence-sharded (by whole batch entries, such as frames, or heads: each rank attends within its own, "
             "no communication)")
    SINGLE_QUERY = "whole on every rank: a single query row (a pooling) has no rows to split"
    WHOLE = "not sequence-sharded"


@dataclass(frozen=True)
class AttentionSequence:
    """An attention's decision over one sequence axis; ``reason``: why a WHOLE one is not sharded, ``about``: the
    module (or node) a rule's refusal names, if it names one."""
    kind: SequenceKind
    reason: str = ""
    about: str = ""

    @property
    def sharded(self) -> bool:
        return self.kind in (SequenceKind.ULYSSES, SequenceKind.RING, SequenceKind.QUERY_ROWS, SequenceKind.BATCH)

    @property
    def why(self) -> str:
        """The reason as the rule gave it: naming what it is about."""
        return f"{self.about}: {self.reason}" if self.about else self.reason

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.why}" if self.why else self.kind.value


@dataclass(frozen=True)
class AttentionSequencing:
    """An attention's decisions, one per sequence axis that splits (in mesh order)."""
    by_axis: tuple[tuple[str, AttentionSequence], ...]

    @property
    def sharded(self) -> bool:
        """Sequence-sharded over every sequence axis."""
        return all(decision.sharded for _, decision in self.by_axis)

    @property
    def single_query(self) -> bool:
        return any(d.kind is SequenceKind.SINGLE_QUERY for _, d in self.by_axis)

    def __str__(self) -> str:
        if len(self.by_axis) == 1:
            return str(self.by_axis[0][1])
        return "; ".join(f"{axis}: {decision}" for axis, decision in self.by_axis)


@dataclass(frozen=True)
class BatchSplit:
    """A user input over the dp/cfg axis: split along dim 0, or why not."""
    split: bool
    reason: str = ""

    def __str__(self) -> str:
        return "split along dim 0" if self.split else f"not split: its rows meet {self.reason}"


@dataclass(frozen=True)
class Chunking:
    """A row-parallel Linear's all_reduce: in how many chunks it is issued (1: whole), and why."""
    chunks: int
    reason: str

    def __str__(self) -> str:
        return f"{self.chunks} chunks ({self.reason})" if self.chunks > 1 else f"whole ({self.reason})"


class HostKind(enum.Enum):
    DATA_DEPENDENT = "output size depends on tensor values"
    RESULT = "result of"
    FEEDS_HOST = "feeds only the host prologue"


@dataclass(frozen=True)
class Hoisted:
    """Why a node runs in the host prologue: its op's output size depends on values, it unpacks such an op's
    result (``source``), or it feeds only the prologue."""
    kind: HostKind
    op: str
    source: str = ""

    def __str__(self) -> str:
        if self.kind is HostKind.RESULT:
            return f"result of {self.source}"
        return f"{self.op}: {self.kind.value}"


# every decision type: a test gives each a random ``__str__`` and checks that no rank program changes
DECISIONS = (Style, LinearSharding, ValueKey, SequenceSeed, SequenceKind, AttentionSequence, AttentionSequencing,
             BatchSplit, Chunking, HostKind, Hoisted)
