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
from dataclasses import dataclass, field
from pathlib import Path

from .decisions import LinearSharding, SequenceSeed
from .errors import InputError, MeshError

VERSION = 2


@dataclass
class Plan:
    mesh: dict[str, int]  # axis sizes the plan was made for
    # module path -> its decision; an edit may give a style name ("colwise", "rowwise", "replicate") instead
    linears: dict[str, LinearSharding | str] = field(default_factory=dict)
    # sequence axis -> where its sharding starts (values by their ``ValueKey``); None: derived again when applied
    sequence_seeds: dict[str, tuple[SequenceSeed, ...]] | None = field(default_factory=dict)
    bounds: dict[str, int] = field(default_factory=dict)  # data-dependent op -> bound
    # read-only, derived again when applied: attention module -> sharded over each sequence axis, or why not
    attention: dict[str, str] = field(default_factory=dict)
    version: int = VERSION

    @classmethod
    def of(cls, partitioned) -> "Plan":
        """The decisions a ``Partitioned`` (or the ``PassContext`` of the planning passes) holds."""
        ctx = getattr(partitioned, "ctx", partitioned)
        return cls(dict(ctx.mesh.sizes), dict(ctx.linear_styles), dict(ctx.sequence_seeds), dict(ctx.bounds),
                   {path: str(decided) for path, decided in ctx.sequence_attention.items()})

    def linear_decisions(self) -> dict[str, LinearSharding]:
        """Every Linear's entry as a decision (a style name given by an edit becomes one); ``InputError`` naming
        an entry that is neither."""
        return {path: LinearSharding.of(entry, path) for path, entry in self.linears.items()}

    def _decisions(self, linear_fields=LinearSharding.as_json) -> dict:
        """The decisions as JSON values: what the file holds besides ``attention``; with ``LinearSharding.applied``,
        what is hashed."""
        seeds = None if self.sequence_seeds is None else {
            axis: [seed.as_json() for seed in seeds] for axis, seeds in self.sequence_seeds.items()}
        return {"version": self.version, "mesh": self.mesh, "bounds": self.bounds, "sequence_seeds": seeds,
                "linears": {path: linear_fields(decided) for path, decided in self.linear_decisions().items()}}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps({**self._decisions(), "attention": self.attention}, indent=1, sort_keys=True)
        if path is not None:
            Path(path).write_text(text)
        return text

    @property
    def fingerprint(self) -> str:
        """A digest of the decisions applied (not of ``attention``'s text, which a rewording changes, nor of what is
        derived again: a Linear's ``widths`` and ``gathered``)."""
        applied = json.dumps(self._decisions(LinearSharding.applied), sort_keys=True)
        return hashlib.sha256(applied.encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, source: str | Path) -> "Plan":
        """A plan from JSON text or a file holding it. ``InputError`` naming the file (or text) and the field for a
        missing, unreadable, truncated or malformed plan."""
        where, data = _read(source)
        version = data.get("version")
        if version == 1 and type(version) is int:
            raise InputError(f"{where}: plan version 1 found its sequence seeds by fx node names, which change "
                             "with any retrace; make the plan again with partitioner.plan(...) and save it (version "
                             f"{VERSION} keys values by module, op and structure)")
        if version != VERSION or type(version) is not int:
            raise InputError(f"{where}: plan version {data.get('version')!r}: this partitioner reads version {VERSION}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InputError(f"{where}: plan has unknown fields {sorted(unknown)}")
        if "mesh" not in data:
            raise InputError(f"{where}: plan has no field 'mesh'")
        for name, kind, values in _FIELDS:
            value = data.get(name)
            if value is None and name in data and name == "sequence_seeds":
                continue
            if name in data and (not isinstance(value, kind) or not _entries_are(value, values)):
                raise InputError(f"{where}: field {name!r} must be {_KINDS[name]}, got {_short(value)}")
        try:
            linears = {path: LinearSharding.from_json(entry, path) for path, entry in data.get("linears", {}).items()}
        except InputError as error:
            raise InputError(f"{where}: {error}") from None
        seeds = data.get("sequence_seeds", {})
        if seeds is not None:
            seeds = {axis: tuple(SequenceSeed.from_json(seed, f"{where}: sequence seed {i} over {axis!r}")
                                 for i, seed in enumerate(entries)) for axis, entries in seeds.items()}
        return cls(data["mesh"], linears, seeds, data.get("bounds", {}), data.get("attention", {}))

    def check_mesh(self, sizes: dict[str, int]) -> None:
        if dict(sizes) != dict(self.mesh):
            raise MeshError(f"the plan was made for the mesh {self.mesh}, not {dict(sizes)}: plan again for this mesh")


def _read(source) -> tuple[str, dict]:
    if isinstance(source, (str, Path)) and not isinstance(source, Path) and str(source).lstrip().startswith("{"):
        text, where = str(source), "plan JSON text"
    elif isinstance(source, (str, Path)):
        if str(source).strip() in ("", "."):
            raise InputError(f"Plan.from_json({source!r}): give a plan file's path or its JSON text")
        where = f"plan file {str(source)!r}"
        try:
            text = Path(source).read_text()
        except FileNotFoundError:
            raise InputError(f"{where} does not exist; write one with plan.to_json(path)") from None
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"{where} cannot be read: {type(error).__name__}: {error}") from None
    else:
        raise InputError(f"Plan.from_json takes a path or JSON text, got {type(source).__name__}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{where} is not valid JSON ({error}); it may be truncated: write it again with "
                         "plan.to_json(path)") from None
    if not isinstance(data, dict):
        raise InputError(f"{where} holds a JSON {type(data).__name__}, not a plan object")
    return where, data


_FIELDS = [("mesh", dict, int), ("linears", dict, (dict, str)), ("sequence_seeds", dict, list),
           ("attention", dict, str), ("bounds", dict, int)]
_KINDS = {"mesh": "an object of axis sizes such as {\"tp\": 2}",
          "linears": "an object of module path -> {\"style\": ..., \"blocks\": ..., \"unit\": ...}",
          "sequence_seeds": "null or an object of sequence axis -> [seed, ...]",
          "attention": "an object of module path -> text", "bounds": "an object of op -> integer bound"}


def _entries_are(value: dict, kind) -> bool:
    return all(isinstance(key, str) and isinstance(entry, kind) and not isinstance(entry, bool)
               for key, entry in value.items())


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
