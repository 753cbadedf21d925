"""Deciding and applying as separate steps.

``partitioner.plan(model, mesh, example_inputs)`` runs the planning passes only and returns their decisions as a
value, a ``Plan``: the style of every Linear over the tensor axis, where the sequence sharding starts (and which
attention it reaches, and why the others are left whole), and the bounds of data-dependent sizes. A plan is saved
and read as JSON (``to_json`` / ``Plan.from_json``), can be edited (a Linear's style, a sequence seed removed), and
is applied with ``partition(model, mesh, example_inputs, plan=plan)``, which then derives nothing: every Linear is
placed as the plan says and the sequence is sharded where the plan says, or the partition is refused naming the
entry that cannot be applied. Ranks compare their plans' ``fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import InputError, MeshError

VERSION = 1
_STYLE = re.compile(r"^(colwise|rowwise|replicate)(?: packed \[(\d+(?:, \d+)*)\])?(?: uneven \d+-\d+)?"
                    r"(?: in units of (\d+))?(?: gathered)?$")


@dataclass
class Plan:
    mesh: dict[str, int]  # axis sizes the plan was made for
    linears: dict[str, str] = field(default_factory=dict)  # module path -> colwise / colwise packed [..] / rowwise
    sequence_seeds: dict[str, int] = field(default_factory=dict)  # value (node name) -> the dim sharded there
    attention: dict[str, str] = field(default_factory=dict)  # attention module -> sharded, or why not (read-only)
    bounds: dict[str, int] = field(default_factory=dict)  # data-dependent op -> bound
    version: int = VERSION
    # with two sequence axes (ring x ulysses), each axis's seeds; ``sequence_seeds`` then holds the innermost's
    sequence_seeds_by_axis: dict[str, dict[str, int]] | None = None
    # read-only, derived again when applied: rows between the tp regions, and each input's batch split (dp/cfg)
    tp_sequence: str = ""
    reduce_scattered: dict[str, str] = field(default_factory=dict)
    batch_split: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, partitioned) -> "Plan":
        """The decisions a ``Partitioned`` (or the ``PassContext`` of the planning passes) holds."""
        ctx = getattr(partitioned, "ctx", partitioned)
        by_axis = dict(ctx.sequence_seeds_by_axis) if len(ctx.sequence_seeds_by_axis) > 1 else None
        return cls(dict(ctx.mesh.sizes), dict(ctx.linear_styles), dict(ctx.sequence_seeds),
                   dict(ctx.sequence_attention), dict(ctx.bounds), sequence_seeds_by_axis=by_axis,
                   tp_sequence=ctx.tp_sequence, reduce_scattered=dict(ctx.reduce_scattered),
                   batch_split=dict(ctx.batch_split))

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(asdict(self), indent=1, sort_keys=True)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> "Plan":
        """A plan from JSON text or a file holding it."""
        text = Path(source).read_text() if isinstance(source, Path) or not str(source).lstrip().startswith("{") \
            else str(source)
        data = json.loads(text)
        if data.get("version") != VERSION:
            raise InputError(f"plan version {data.get('version')!r}: this partitioner reads version {VERSION}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InputError(f"plan has unknown fields {sorted(unknown)}")
        return cls(**data)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def linear_overrides(self) -> dict[str, tuple[str, tuple[int, ...] | None, int]]:
        """Every Linear's style as an exact override: path -> (style, packed blocks or None, unit)."""
        overrides = {}
        for path, style in self.linears.items():
            match = _STYLE.match(style)
            if match is None:
                raise InputError(f"plan entry {path!r}: style {style!r} is not one of colwise, colwise packed [a, b], "
                                 "colwise [packed [a, b]] in units of n, rowwise, replicate")
            blocks = tuple(int(b) for b in match[2].split(", ")) if match[2] else None
            overrides[path] = (match[1], blocks, int(match[3] or 1))
        return overrides

    def check_mesh(self, sizes: dict[str, int]) -> None:
        if dict(sizes) != dict(self.mesh):
            raise MeshError(f"the plan was made for the mesh {self.mesh}, not {dict(sizes)}: plan again for this mesh")
