"""Every model a diffusion pipeline carries, as a row of docs/models.md (``benchmarks/models.py``): each transformer
class of the installed diffusers, listed from the package (a class added to ``diffusers.models.transformers`` gets a
row), and the text-encoder families of ``encoders``. A transformer's builder is the zoo's (``zoo``: a tiny config,
inputs as its pipeline builds them), else a tiny config of ``catalog_configs`` with the input builder of
``frontend.pipeline_sizes.BUILDERS``; a class with none is a row that says so.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from . import encoders, zoo
from ..frontend.pipeline_sizes import BUILDERS
from .catalog_configs import CATALOG_CONFIGS


@dataclass(frozen=True)
class Entry:
    name: str  # the diffusers class, or the encoder family
    kind: str  # "transformer" or "text encoder"
    key: str | None  # its builder's name in the zoo or in ``encoders`` (None: no input builder)
    build: Callable[[], torch.nn.Module] | None
    inputs: Callable[..., tuple[tuple, dict]] | None


def transformer_classes() -> list[str]:
    """The ``ModelMixin`` classes defined under ``diffusers.models.transformers`` (its files, and modules added
    under it at run time), sorted by name."""
    import diffusers
    import diffusers.models.transformers as package

    names = {module.name for module in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
    names |= {name for name in sys.modules if name.startswith(package.__name__ + ".")}  # (modules added at run time)
    found = set()
    for name in names:
        loaded = importlib.import_module(name)
        found |= {name for name, value in vars(loaded).items() if inspect.isclass(value)
                  and issubclass(value, diffusers.ModelMixin) and value.__module__ == loaded.__name__}
    return sorted(found)


def catalog() -> dict[str, Entry]:
    """Every transformer class, then every encoder family, with its builder where the package has one: the zoo's,
    else ``catalog_configs``'s."""
    by_class = {model.cls: name for name, model in zoo.ZOO.items()}
    entries = {}
    for cls in transformer_classes():
        key = by_class.get(cls)
        if key is not None:
            entries[cls] = Entry(cls, "transformer", key, lambda key=key: zoo.build(key),
                                 lambda key=key, **sizes: zoo.inputs(key, **sizes))
        elif cls in CATALOG_CONFIGS:
            entries[cls] = Entry(cls, "transformer", cls, lambda cls=cls: build_tiny(cls),
                                 lambda cls=cls, **sizes: BUILDERS[cls](filled_config(cls), **sizes))
        else:
            entries[cls] = Entry(cls, "transformer", None, None, None)
    for key, encoder in encoders.ENCODERS.items():
        entries[encoder.cls] = Entry(encoder.cls, "text encoder", key, lambda key=key: encoders.build(key),
                                     lambda key=key, **sizes: encoders.inputs(key, **sizes))
    return entries


def filled_config(cls: str) -> dict:
    """``CATALOG_CONFIGS[cls]`` with the class defaults filled in, as ``model.config`` shows it."""
    import diffusers

    defaults = {k: p.default for k, p in inspect.signature(getattr(diffusers, cls).__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **CATALOG_CONFIGS[cls]}


def build_tiny(cls: str) -> torch.nn.Module:
    """``CATALOG_CONFIGS[cls]`` built tiny and random, the same on every process (``zoo.seeded``)."""
    import diffusers

    return zoo.seeded(lambda: getattr(diffusers, cls)(**CATALOG_CONFIGS[cls]))


def partition_case(rank: int, world: int, name: str, shape: tuple, names: tuple, sizes: dict | None = None) -> dict:
    """``catalog()[name]`` partitioned on the running ranks, each rank's output against the model's
    (``zoo_check.partition_case`` or ``encoders.partition_case``); an exception that is not a refusal is reported
    (``status`` failed), not raised, so one model's defect does not stop the survey."""
    from .zoo_check import model_case, partition_case as zoo_case

    entry = catalog()[name]
    try:
        if entry.kind == "text encoder":
            return encoders.partition_case(rank, world, entry.key, shape, names, sizes)
        if entry.key in zoo.ZOO:
            return zoo_case(rank, world, entry.key, shape, names, sizes)
        return model_case(rank, world, entry.build(), entry.inputs(**(sizes or {})), shape, names)
    except Exception as error:  # noqa: BLE001  (a raw exception is a defect of this package: the table says so)
        first = (str(error).strip().splitlines() or [""])[0]
        return dict(status="failed", error_type=type(error).__name__, message=f"{type(error).__name__}: {first}"[:500])
