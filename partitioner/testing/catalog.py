"""Every model a diffusion pipeline carries, as a row of docs/models.md (``benchmarks/models.py``): each transformer
class of the installed diffusers, listed from the package (a class added to ``diffusers.models.transformers`` gets a
row), and the text-encoder families of ``encoders``. A transformer's builder is the zoo's (``zoo``: a tiny config,
inputs as its pipeline builds them); a class with none is a row that says so.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from typing import Callable

import torch

from . import encoders, zoo


@dataclass(frozen=True)
class Entry:
    name: str  # the diffusers class, or the encoder family
    kind: str  # "transformer" or "text encoder"
    key: str | None  # its builder's name in the zoo or in ``encoders`` (None: no input builder)
    build: Callable[[], torch.nn.Module] | None
    inputs: Callable[..., tuple[tuple, dict]] | None


def transformer_classes() -> list[str]:
    """The ``ModelMixin`` classes defined under ``diffusers.models.transformers``, sorted by name."""
    import diffusers
    import diffusers.models.transformers as package

    found = set()
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        loaded = importlib.import_module(module.name)
        found |= {name for name, value in vars(loaded).items() if inspect.isclass(value)
                  and issubclass(value, diffusers.ModelMixin) and value.__module__ == loaded.__name__}
    return sorted(found)


def catalog() -> dict[str, Entry]:
    """Every transformer class, then every encoder family, with its builder where the package has one."""
    by_class = {model.cls: name for name, model in zoo.ZOO.items()}
    entries = {}
    for cls in transformer_classes():
        key = by_class.get(cls)
        entries[cls] = Entry(cls, "transformer", key, (lambda key=key: zoo.build(key)) if key else None,
                             (lambda key=key, **sizes: zoo.inputs(key, **sizes)) if key else None)
    for key, encoder in encoders.ENCODERS.items():
        entries[encoder.cls] = Entry(encoder.cls, "text encoder", key, lambda key=key: encoders.build(key),
                                     lambda key=key, **sizes: encoders.inputs(key, **sizes))
    return entries


def partition_case(rank: int, world: int, name: str, shape: tuple, names: tuple, sizes: dict | None = None) -> dict:
    """``catalog()[name]`` partitioned on the running ranks, each rank's output against the model's
    (``zoo_check.partition_case`` or ``encoders.partition_case``)."""
    from .zoo_check import partition_case as zoo_case

    entry = catalog()[name]
    case = zoo_case if entry.kind == "transformer" else encoders.partition_case
    return case(rank, world, entry.key, shape, names, sizes)
