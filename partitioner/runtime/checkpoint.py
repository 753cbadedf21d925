"""Shard-on-read: every rank reads only its own slices of each tensor from safetensors files.

A 33B checkpoint never passes through one rank: ``safe_open(...).get_slice(name)[ranges]`` copies just the rows
and columns the rank's slicing spec names (each block of a packed tensor separately). Single files and diffusers'
sharded layout (``diffusion_pytorch_model.safetensors.index.json``) are both read. Everything is checked before
anything is used: missing, unexpected, mis-shaped or mis-typed tensors and unreadable files raise one
``CheckpointError`` listing them.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..mesh import MeshSpec
from ..progress import bar
from ..placement import PackedShard, is_sharded, shard_slices

INDEX = "diffusion_pytorch_model.safetensors.index.json"
SINGLE = "diffusion_pytorch_model.safetensors"


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a file, an index file or a diffusers model folder."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / INDEX, path / SINGLE):
            if candidate.exists():
                path = candidate
                break
        else:
            found = sorted(path.glob("*.safetensors.index.json")) or sorted(path.glob("*.safetensors"))
            if len(found) != 1:
                raise CheckpointError(f"{path}: expected {INDEX}, {SINGLE} or a single *.safetensors file, found "
                                      f"{[f.name for f in found] or 'none'}")
            path = found[0]
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path}: not a safetensors index (needs a 'weight_map'): "
                                  f"{type(error).__name__}: {error}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise CheckpointError(f"{path}: 'weight_map' must map each tensor name to its file name, got "
                                  f"{type(weight_map).__name__} {str(weight_map)[:80]}")
        return {name: path.parent / file for name, file in weight_map.items()}
    with _open(path) as handle:
        return {name: path for name in handle.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def shard_ranges(shape, spec: dict, mesh: MeshSpec) -> list[list[tuple[int, int]]]:
    """For each dim, the ``[start, end)`` ranges this rank holds (several for a packed dim), axes in mesh order."""
    ranges = [[(0, size)] for size in shape]
    for axis in mesh.axis_names:
        placement = spec.get(axis)
        if not is_sharded(placement):
            continue
        (start, end), *rest = ranges[placement.dim]
        if rest or (isinstance(placement, PackedShard) and (start, end) != (0, shape[placement.dim])):
            raise CheckpointError(f"nested sharding of a packed dim is not supported ({spec})")
        ranges[placement.dim] = [(start + a, start + b) for a, b in
                                 shard_slices(placement, end - start, mesh.size(axis), mesh.coordinate(axis))]
    return ranges


def read_shard(handle, name: str, spec: dict, mesh: MeshSpec) -> torch.Tensor:
    """This rank's part of tensor ``name``, in memory of its own: only its bytes are copied out of the file.
    (safetensors hands out views of the memory-mapped file; a copy makes the shard contiguous and independent of
    the file's pages.)"""
    view = handle.get_slice(name)
    ranges = shard_ranges(view.get_shape(), spec, mesh)
    packed = [d for d, r in enumerate(ranges) if len(r) > 1]
    pieces = [view[tuple(slice(a, b) for a, b in combo)] for combo in itertools.product(*ranges)]
    if not packed:
        return pieces[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(pieces, dim=packed[0])


def load_shards(path, expected: dict[str, tuple[torch.Size, torch.dtype]], specs: dict[str, dict], mesh: MeshSpec,
                *, strict: bool = True, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Read this rank's slice of every tensor in ``expected`` (name -> global shape and dtype); a name missing from
    the checkpoint is looked up under its alias (``aliases``: torchao's flattened name of a quantised weight's
    part, ``to_q._weight_qdata`` for ``to_q.weight.qdata``)."""
    files = tensor_files(path)
    stored = {name: name if name in files or name not in (aliases or {}) else aliases[name] for name in expected}
    problems = []
    missing = sorted(name for name in expected if stored[name] not in files)
    if missing:
        problems.append(f"missing {len(missing)}: {missing[:10]}")
    unexpected = sorted(set(files) - set(stored.values()))
    if unexpected and strict:
        problems.append(f"unexpected {len(unexpected)}: {unexpected[:10]}")
    present = [name for name in sorted(expected) if stored[name] in files]
    handles = {file: _open(file) for file in sorted(set(files[stored[n]] for n in present))}
    held = {file: set(handle.keys()) for file, handle in handles.items()}
    for name in present:
        key, file = stored[name], files[stored[name]]
        if key not in held[file]:
            problems.append(f"{key}: the index maps it to {file.name}, which does not hold it")
            continue
        view = handles[file].get_slice(key)
        shape, dtype = expected[name]
        if tuple(view.get_shape()) != tuple(shape):
            problems.append(f"{key}: shape {view.get_shape()} in {file.name}, the model has {list(shape)}")
        elif _dtype(view.get_dtype()) != dtype:
            problems.append(f"{key}: {view.get_dtype()} in {file.name}, the model was traced with {dtype}; "
                            "build the model with the checkpoint's dtypes")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the partitioned model:\n  " + "\n  ".join(problems))
    shards = {}
    names = sorted(expected)
    for name in bar(names, desc="loading shards", unit="tensor"):
        key = stored[name]
        try:
            shards[name] = read_shard(handles[files[key]], key, specs.get(name, {}), mesh)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise CheckpointError(f"{files[key]}: cannot read {key} ({error}); the file may be truncated") from None
    return shards


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _dtype(name: str) -> torch.dtype | str:
    return _DTYPES.get(name.upper(), name)
