"""The sizes each diffusers pipeline passes its transformer at its usual resolutions (``PIPELINE_SIZES``), and
``pipeline_example``: a model's example inputs at those sizes, built by its builder in ``pipeline_inputs``."""

from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

from ..errors import InputError, did_you_mean
from . import pipeline_inputs_a_h, pipeline_inputs_h_o, pipeline_inputs_p_z
from .pipeline_inputs import (allegro_inputs, auraflow_inputs, bria_inputs, chroma_inputs, chronoedit_inputs,
                              cogvideox_inputs, cogview4_inputs, easyanimate_inputs, flux2_inputs, flux_inputs,
                              hidream_inputs, hunyuan_video15_inputs, hunyuan_video_inputs, kandinsky5_inputs,
                              ltx_video_inputs, lumina2_inputs, minimax_h3_inputs, mochi_inputs, pixart_inputs,
                              qwen_image_inputs, sana_inputs, sd3_inputs, wan_inputs, wan_vace_inputs)

# --- the sizes pipelines pass ---------------------------------------------------------------------------------------

# What each model's diffusers pipeline passes at its usual resolutions, in the input builder's units (latent sizes
# before patching; ``text``: the rows the text encoder gives, ``pad`` of them padding). Odd text lengths and row
# counts equal to a feature width are what users bring: Flux at 1024x768 has 3072 image rows, its inner width.
PIPELINE_SIZES: dict[str, dict[str, dict]] = {  # diffusers class name -> {preset: sizes}; the first the default
    "FluxTransformer2DModel": {
        "1024x1024": dict(text=512, height=128, width=128),
        "1024x768": dict(text=512, height=96, width=128),
    },
    "Flux2Transformer2DModel": {
        "1024x1024": dict(text=512, height=128, width=128),
    },
    "SD3Transformer2DModel": {  # 77 CLIP + 256 T5 rows
        "1024x1024": dict(text=333, height=128, width=128),
    },
    "AuraFlowTransformer2DModel": {
        "1024x1024": dict(text=256, height=128, width=128),
    },
    "PixArtTransformer2DModel": {
        "1024x1024": dict(text=300, pad=281, height=128, width=128),
    },
    "SanaTransformer2DModel": {  # DC-AE: 32x down
        "1024x1024": dict(text=300, pad=281, height=32, width=32),
    },
    "Lumina2Transformer2DModel": {
        "1024x1024": dict(text=256, pad=237, height=128, width=128),
    },
    "HiDreamImageTransformer2DModel": {
        "1024x1024": dict(text=128, height=128, width=128),
    },
    "HunyuanVideoTransformer3DModel": {
        "480p 129f": dict(text=256, pad=231, frames=33, height=60, width=106),
        "720p 129f": dict(text=256, pad=231, frames=33, height=90, width=160),
    },
    # Qwen rows to 1000 (+ a template), ByT5 256, 729 SigLIP rows; the VAE compresses 16x in space and 4x in time
    "HunyuanVideo15Transformer3DModel": {
        "480p 121f": dict(text=1000, pad=977, text_2=256, pad_2=249, image_rows=729, frames=31, height=30, width=53),
    },
    "WanTransformer3DModel": {
        "480p 81f": dict(text=512, pad=487, frames=21, height=60, width=104),
        "720p 81f": dict(text=512, pad=487, frames=21, height=90, width=160),
    },
    "LTXVideoTransformer3DModel": {
        "704x480 161f": dict(text=128, pad=109, frames=21, height=15, width=22),
        "1216x704 161f": dict(text=128, pad=109, frames=21, height=22, width=38),
    },
    "MochiTransformer3DModel": {
        "480p 163f": dict(text=256, pad=237, frames=28, height=60, width=106),
    },
    "CogVideoXTransformer3DModel": {
        "720x480 49f": dict(text=226, frames=13, height=60, width=90),
    },
    "CogView4Transformer2DModel": {  # GLM rows, padded to a multiple of 16
        "1024x1024": dict(text=48, height=128, width=128),
    },
    "QwenImageTransformer2DModel": {
        "1024x1024": dict(text=23, height=128, width=128),
        "1328x1328": dict(text=37, height=166, width=166),
    },
    "AllegroTransformer3DModel": {
        "720p 88f": dict(text=512, pad=491, frames=22, height=90, width=160),
    },
    "MiniMaxH3Transformer3DModel": {  # 37888 packed rows
        "768p 124f": dict(text=178, video=37198, audio=512),
    },
    "ChromaTransformer2DModel": {
        "1024x1024": dict(text=512, pad=493, height=128, width=128),
    },
    "BriaTransformer2DModel": {
        "1024x1024": dict(text=128, height=128, width=128),
    },
    "SkyReelsV2Transformer3DModel": {
        "540p 97f": dict(text=512, pad=487, frames=25, height=68, width=120),
    },
    "ChronoEditTransformer3DModel": {
        "720p 5f": dict(text=512, pad=487, frames=2, height=90, width=160, image_rows=257),
    },
    "WanVACETransformer3DModel": {
        "480p 81f": dict(text=512, pad=487, frames=21, height=60, width=104),
    },
    "Kandinsky5Transformer3DModel": {
        "768x512 121f": dict(text=256, frames=31, height=64, width=96),
    },
    "EasyAnimateTransformer3DModel": {
        "672x384 49f": dict(text=256, frames=13, height=48, width=84),
    },
}

BUILDERS = {  # diffusers class name -> its input builder
    "AllegroTransformer3DModel": allegro_inputs,
    "AuraFlowTransformer2DModel": auraflow_inputs,
    "BriaTransformer2DModel": bria_inputs,
    "ChromaTransformer2DModel": chroma_inputs,
    "ChronoEditTransformer3DModel": chronoedit_inputs,
    "CogVideoXTransformer3DModel": cogvideox_inputs,
    "CogView4Transformer2DModel": cogview4_inputs,
    "EasyAnimateTransformer3DModel": easyanimate_inputs,
    "Flux2Transformer2DModel": flux2_inputs,
    "FluxTransformer2DModel": flux_inputs,
    "HiDreamImageTransformer2DModel": hidream_inputs,
    "HunyuanVideo15Transformer3DModel": hunyuan_video15_inputs,
    "HunyuanVideoTransformer3DModel": hunyuan_video_inputs,
    "Kandinsky5Transformer3DModel": kandinsky5_inputs,
    "LTXVideoTransformer3DModel": ltx_video_inputs,
    "Lumina2Transformer2DModel": lumina2_inputs,
    "MiniMaxH3Transformer3DModel": minimax_h3_inputs,
    "MochiTransformer3DModel": mochi_inputs,
    "PixArtTransformer2DModel": pixart_inputs,
    "QwenImageTransformer2DModel": qwen_image_inputs,
    "SD3Transformer2DModel": sd3_inputs,
    "SanaTransformer2DModel": sana_inputs,
    "SkyReelsV2Transformer3DModel": wan_inputs,
    "WanTransformer3DModel": wan_inputs,
    "WanVACETransformer3DModel": wan_vace_inputs,
}
# the catalog's other classes (benchmarks/models.py), at their builders' sizes (no production preset yet)
BUILDERS.update({**pipeline_inputs_a_h.BUILDERS, **pipeline_inputs_h_o.BUILDERS, **pipeline_inputs_p_z.BUILDERS})


def pipeline_example(model: torch.nn.Module, preset: str | None = None, seed: int = 0, *, meta: bool = True,
                     **sizes) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model`` (a diffusers transformer, on any device) as its pipeline builds them: at the
    sizes of ``preset`` (a key of ``PIPELINE_SIZES[class]``; by default its first, the pipeline's usual
    resolution), each overridden by ``sizes``. With ``meta``, float inputs are on the meta device when the model is
    (ids and masks keep their values: a model that reads them is traced for them; a model that branches on a float
    input's values needs them real: ``meta=False``)."""
    name = type(model).__name__
    if name not in BUILDERS:
        raise InputError(f"no input builder is known for {name}{did_you_mean(name, BUILDERS)}; classes with one: "
                         f"{sorted(BUILDERS)}. Use the Python API with your own example_inputs")
    presets = PIPELINE_SIZES.get(name, {})
    if preset is not None and preset not in presets:
        raise InputError(f"{name} has no size preset {preset!r}{did_you_mean(preset, presets)}; presets: "
                         f"{sorted(presets)}")
    builder = BUILDERS[name]
    known = [p for p in inspect.signature(builder).parameters if p not in ("config", "seed")]
    unknown = [size for size in sizes if size not in known]
    if unknown:
        raise InputError(f"{name}'s inputs have no size {unknown[0]!r}{did_you_mean(unknown[0], known)}; sizes: "
                         f"{known}")
    chosen = {**(presets[preset] if preset else next(iter(presets.values()), {})), **sizes}
    args, kwargs = builder(dict(model.config), seed, **chosen)
    on_meta = meta and any(p.is_meta for p in model.parameters())
    return meta_floats((args, kwargs)) if on_meta else (args, kwargs)


def meta_floats(example: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """Float tensors of ``(args, kwargs)`` moved to the meta device; ids and masks keep their values."""
    to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    args, kwargs = example
    return tuple(pytree.tree_map(to_meta, a) for a in args), {k: pytree.tree_map(to_meta, v) for k, v in kwargs.items()}
