"""A diffusers model named on the command line: a class name (or ``minimax-h3``) with a config given as JSON files
and ``key=value`` pairs, or a ``from_pretrained`` folder; built on the meta device (planning needs no weights) or
with real weights (random and seeded alike on every rank, or the folder's own)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import InputError, did_you_mean

ALIASES = {"minimax-h3": "MiniMaxH3Transformer3DModel"}


def model_class(name: str) -> type:
    """The diffusers model class called ``name`` (or an alias such as ``minimax-h3``)."""
    import diffusers

    cls = getattr(diffusers, ALIASES.get(name, name), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        known = [n for n in dir(diffusers) if n.endswith("Model") or n.endswith("Transformer")] + list(ALIASES)
        raise InputError(f"{name!r} is not a diffusers model class{did_you_mean(name, known)}; name one such as "
                         "FluxTransformer2DModel, or give a config.json whose '_class_name' names it")
    return cls


def _value(text: str):
    """A ``--config`` value as JSON (numbers, lists, true/null), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def read_config(items: list[str], pretrained: str | None = None) -> dict:
    """A config from a ``from_pretrained`` folder's config.json, then each of ``items`` in order: a JSON file (or
    the folder holding config.json) merged in, or ``key=value`` set (value parsed as JSON where it parses)."""
    config: dict = {}
    for item in ([pretrained] if pretrained else []) + list(items):
        if "=" in item and not Path(item).exists():
            key, value = item.split("=", 1)
            config[key.strip()] = _value(value.strip())
            continue
        path = Path(item) / "config.json" if Path(item).is_dir() else Path(item)
        if not path.is_file():
            raise InputError(f"config {item!r} is neither a JSON file, a folder with config.json, nor key=value")
        try:
            config.update(json.loads(path.read_text()))
        except json.JSONDecodeError as error:
            raise InputError(f"{path} is not valid JSON: {error}") from None
    return config


def build_model(name: str | None, config_items: list[str] = (), pretrained: str | None = None, *,
                dtype: torch.dtype = torch.bfloat16, weights: str = "meta", seed: int = 0) -> torch.nn.Module:
    """The model in eval mode. ``weights``: "meta" (no memory), "random" (drawn after ``torch.manual_seed(seed)``:
    the same on every rank) or "pretrained" (the folder's own weights)."""
    config = read_config(list(config_items), pretrained)
    name = name or config.get("_class_name")
    if not name:
        raise InputError("name the model: --model CLASS (e.g. FluxTransformer2DModel), or a config whose "
                         "'_class_name' names it (--config config.json, --pretrained FOLDER)")
    cls = model_class(name)
    keys = cls._get_init_keys(cls)
    unknown = sorted(set(config) - set(keys) - {k for k in config if k.startswith("_")})
    if unknown:
        raise InputError(f"{cls.__name__} takes no config key {unknown[0]!r}{did_you_mean(unknown[0], keys)}")
    if weights == "pretrained":
        if not pretrained:
            raise InputError("real weights need --pretrained FOLDER")
        model = cls.from_pretrained(pretrained, torch_dtype=dtype)
    elif weights == "meta":
        with torch.device("meta"):
            model = cls.from_config(config)
    else:
        torch.manual_seed(seed)
        model = cls.from_config(config)
    return apply_dtype(model.eval(), dtype)


def apply_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast to ``dtype`` except what the model keeps in float32 (diffusers' ``_keep_in_fp32_modules``, matched as
    substrings of tensor names, as diffusers does), e.g. H3's patch projections, timestep MLP and output heads."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if any(p in name for p in keep) else dtype)
    return model
