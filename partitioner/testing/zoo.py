"""A zoo of diffusers transformers for tests: tiny random-weight configs that run in a second on a CPU, the
production-size configs for tracing on the meta device, and inputs built the way each model's diffusers pipeline
builds them.

Tiny configs share one shape budget so that every model exercises the same sharding cases: at most 2 layers of each
block type, 4+ heads of 8-16 dims (2-way tensor and sequence parallel both split heads), about 16 image/video tokens
and 6-8 text tokens, batch 1. ``notes`` records what was observed with diffusers 0.42.1 and torch 2.13 (CPU): eager
run, ``torch.export.export(..., strict=False)``, and the full config's parameter count. ``python -m
partitioner.testing.zoo_check`` re-checks all of it.

Each model's ``make_inputs(config, seed=0, **sizes)`` is in ``partitioner.frontend.pipeline_inputs`` (an unknown
size is a ``TypeError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InputError
from .models import TINY_COGVIDEOX, TINY_COGVIEW4, TINY_H3
from ..frontend.pipeline_sizes import PIPELINE_SIZES as SIZES_BY_CLASS
from ..frontend.pipeline_inputs import (allegro_inputs, auraflow_inputs, bria_inputs, chroma_inputs, chronoedit_inputs,
                         cogvideox_inputs, cogview4_inputs, easyanimate_inputs, flux2_inputs, flux_inputs,
                         hidream_inputs, hunyuan_video_inputs, hunyuan_video15_inputs, kandinsky5_inputs,
                         ltx_video_inputs, lumina2_inputs, minimax_h3_inputs, mochi_inputs, pixart_inputs,
                         qwen_image_inputs, sana_inputs, sd3_inputs, wan_inputs, wan_vace_inputs)

__all__ = ["PIPELINE_SIZES", "ZOO", "ZooModel", "build", "config", "inputs", "odd_sizes"]


@dataclass(frozen=True)
class ZooModel:
    name: str  # e.g. "flux"
    cls: str  # diffusers class name, e.g. "FluxTransformer2DModel"
    tiny: dict  # config kwargs of a tiny model
    full: dict | None  # config kwargs of the production-size model (for meta-device tracing), None if unknown
    make_inputs: Callable  # (config, seed=0, **sizes) -> (args, kwargs) of CPU tensors
    notes: str = ""


# --- configs ----------------------------------------------------------------------------------------------------------

_ROPE16 = (4, 6, 6)  # three rotary axes summing to head_dim 16

ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel(
        "flux", "FluxTransformer2DModel",
        tiny=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                  axes_dims_rope=_ROPE16),
        full=dict(in_channels=64, guidance_embeds=True),  # FLUX.1-dev: class defaults + guidance
        make_inputs=flux_inputs,
        notes="eager ok; export ok. full 11.90B params (FLUX.1-dev, from memory)."),
    ZooModel(
        "flux2", "Flux2Transformer2DModel",
        tiny=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, timestep_guidance_channels=32,
                  axes_dims_rope=(4, 4, 4, 4)),
        full=dict(),  # FLUX.2-dev: the class defaults
        make_inputs=flux2_inputs,
        notes="eager ok; export ok. full 32.22B params (FLUX.2-dev = the class defaults)."),
    ZooModel(
        "sd3", "SD3Transformer2DModel",
        tiny=dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=32,
                  out_channels=4, pos_embed_max_size=8, qk_norm="rms_norm"),
        full=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
        make_inputs=sd3_inputs,
        notes=("eager ok; export ok. full 8.06B params (SD3.5 Large, from memory: 38 x 64-dim heads, "
              "caption_projection 2432, pos_embed_max_size 192, qk_norm rms_norm).")),
    ZooModel(
        "auraflow", "AuraFlowTransformer2DModel",
        tiny=dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
                  out_channels=4, pos_embed_max_size=64),
        full=dict(),  # AuraFlow v0.3: the class defaults
        make_inputs=auraflow_inputs,
        notes="eager ok; export ok. full 6.83B params (AuraFlow v0.3 = the class defaults)."),
    ZooModel(
        "pixart_sigma", "PixArtTransformer2DModel",
        tiny=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
                  cross_attention_dim=64, sample_size=8, patch_size=2, caption_channels=32,
                  use_additional_conditions=False),
        full=dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                  cross_attention_dim=1152, sample_size=128, patch_size=2, caption_channels=4096,
                  use_additional_conditions=False),  # PixArt-Sigma-XL-2-1024-MS
        make_inputs=pixart_inputs,
        notes=("eager ok; padded text rows verified masked; export ok. full 610.9M params "
              "(PixArt-Sigma-XL-2-1024-MS, from memory).")),
    ZooModel(
        "sana", "SanaTransformer2DModel",
        tiny=dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                  num_cross_attention_heads=4, cross_attention_head_dim=16, cross_attention_dim=64,
                  caption_channels=32, sample_size=4, patch_size=1),
        full=dict(),  # Sana 1600M 1024px: the class defaults
        make_inputs=sana_inputs,
        notes=("eager ok; padded text rows verified masked; export ok. full 1.60B params (Sana 1600M 1024px = the "
              "class defaults).")),
    ZooModel(
        "lumina2", "Lumina2Transformer2DModel",
        tiny=dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=64, num_layers=2, num_refiner_layers=1,
                  num_attention_heads=4, num_kv_heads=2, multiple_of=16, axes_dim_rope=_ROPE16, cap_feat_dim=32),
        full=dict(cap_feat_dim=2304),  # Lumina-Image-2.0: class defaults with Gemma-2-2B's 2304-wide captions
        make_inputs=lumina2_inputs,
        notes=("eager ok; padded text rows verified masked; symbolic export fails: `TypeError: unhashable type: "
              "non-nested SymInt` (forward does `len(set(seq_lengths))` on the row sums of the mask; pad=0 too), so "
              "it is traced for the mask's values (value_specialization). full 2.61B params (Lumina-Image-2.0, from "
              "memory).")),
    ZooModel(
        "hidream", "HiDreamImageTransformer2DModel",
        tiny=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
                  attention_head_dim=16, num_attention_heads=4, caption_channels=[32, 24], text_emb_dim=32,
                  num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(8, 8),
                  llama_layers=[0, 1, 2, 2]),
        full=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                  attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                  num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(64, 32, 32),
                  max_resolution=(128, 128), llama_layers=list(range(32)) + [31] * 16),  # HiDream-I1
        make_inputs=hidream_inputs,
        notes=("eager ok (MoE feed-forward); export fails: `RuntimeError: .numpy() is not supported for tensor "
              "subclasses.` (MoE inference path: `bincount().cpu().numpy()`). full 17.11B params (HiDream-I1, from "
              "memory; the exact llama_layers list is uncertain and does not change the count).")),
    ZooModel(
        "hunyuan_video", "HunyuanVideoTransformer3DModel",
        tiny=dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                  num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
                  pooled_projection_dim=16, rope_axes_dim=_ROPE16),
        full=dict(),  # HunyuanVideo (13B): the class defaults
        make_inputs=hunyuan_video_inputs,
        notes=("eager ok; padded text rows verified masked; export ok. full 12.82B params (HunyuanVideo = the class "
              "defaults).")),
    ZooModel(
        "wan", "WanTransformer3DModel",
        tiny=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2),
        full=dict(),  # Wan 2.1 T2V 14B: the class defaults
        make_inputs=wan_inputs,
        notes="eager ok; export ok. full 14.29B params (Wan 2.1 T2V 14B = the class defaults)."),
    ZooModel(
        "ltx_video", "LTXVideoTransformer3DModel",
        tiny=dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
                  num_layers=2, caption_channels=32),
        full=dict(),  # LTX-Video 0.9 (2B): the class defaults
        make_inputs=ltx_video_inputs,
        notes=("eager ok; padded text rows verified masked; export ok. full 1.92B params (LTX-Video 0.9 = the class "
              "defaults).")),
    ZooModel(
        "mochi", "MochiTransformer3DModel",
        tiny=dict(patch_size=2, num_attention_heads=4, attention_head_dim=16, num_layers=2, pooled_projection_dim=32,
                  in_channels=4, text_embed_dim=32, time_embed_dim=32, max_sequence_length=8),
        full=dict(),  # Mochi 1 preview (10B): the class defaults
        make_inputs=mochi_inputs,
        notes=("eager ok; padded text rows verified masked; export ok, but its attention drops padded prompt rows "
              "with `nonzero` (a size the host prologue cannot take): traced for the mask's values "
              "(value_specialization). full 10.03B params (Mochi 1 preview = the class defaults).")),
    ZooModel(
        "cogvideox", "CogVideoXTransformer3DModel",
        tiny=TINY_COGVIDEOX,
        full=dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
                  text_embed_dim=4096, num_layers=42, sample_width=90, sample_height=60, sample_frames=49,
                  patch_size=2, use_rotary_positional_embeddings=True),  # CogVideoX-5b
        make_inputs=cogvideox_inputs,
        notes="eager ok (rotary passed in); export ok. full 5.57B params (CogVideoX-5b, from memory)."),
    ZooModel(
        "cogview4", "CogView4Transformer2DModel",
        tiny=TINY_COGVIEW4,
        full=dict(num_layers=28, attention_head_dim=128, num_attention_heads=32),  # CogView4-6B
        make_inputs=cogview4_inputs,
        notes=("eager ok; export ok. full 6.37B params (CogView4-6B, from memory, uncertain: 28 layers, 32 x 128 "
              "heads; the class defaults, 30 layers of 64 x 40, differ).")),
    ZooModel(
        "qwen_image", "QwenImageTransformer2DModel",
        tiny=dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=_ROPE16),
        full=dict(),  # Qwen-Image (20B): the class defaults
        make_inputs=qwen_image_inputs,
        notes=("eager ok; export ok (also with pad=2, where padded rows are verified masked). full 20.43B params "
              "(Qwen-Image = the class defaults).")),
    ZooModel(
        "allegro", "AllegroTransformer3DModel",
        tiny=dict(patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=12, in_channels=4,
                  out_channels=4, num_layers=2, cross_attention_dim=48, sample_height=4, sample_width=8,
                  sample_frames=2, caption_channels=32),
        full=dict(),  # Allegro (2.8B): the class defaults
        make_inputs=allegro_inputs,
        notes=("eager ok; padded text rows verified masked; export ok. head_dim 12 because Allegro's rotary splits "
              "head_dim in three even parts. full 2.77B params (Allegro = the class defaults).")),
    ZooModel(
        "minimax_h3", "MiniMaxH3Transformer3DModel",
        tiny=TINY_H3,
        full=dict(),  # MiniMax-H3: the class defaults
        make_inputs=minimax_h3_inputs,
        notes="eager ok; export ok. full 33.12B params (MiniMax-H3 = the class defaults)."),
    # --- added in issue 34 ---
    ZooModel(
        "chroma", "ChromaTransformer2DModel",
        tiny=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=_ROPE16, approximator_num_channels=16,
                  approximator_hidden_dim=32, approximator_layers=2),
        full=dict(),  # Chroma1-HD: the class defaults
        make_inputs=chroma_inputs,
        notes=("eager ok; export ok. Flux's blocks, modulation from a timestep MLP (the approximator) instead of "
               "per-block linears, a joint text + image mask. full 8.9B params (Chroma1-HD = the class defaults).")),
    ZooModel(
        "bria", "BriaTransformer2DModel",
        tiny=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=list(_ROPE16)),
        full=dict(num_layers=8, num_single_layers=28),  # BRIA 3.2, from memory (uncertain): Flux's blocks, fewer
        make_inputs=bria_inputs,
        notes="eager ok; export ok. Flux-like, no pooled text or guidance. full config from memory (uncertain)."),
    ZooModel(
        "skyreels_v2", "SkyReelsV2Transformer3DModel",
        tiny=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2),
        full=dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),  # SkyReels-V2 14B (Wan 14B's sizes)
        make_inputs=wan_inputs,
        notes=("eager ok; export ok. Wan's blocks; one timestep for the video (the diffusion-forcing timestep per "
               "frame is item 4 of issue 34). full: Wan 2.1 14B's sizes, from memory.")),
    ZooModel(
        "chronoedit", "ChronoEditTransformer3DModel",
        tiny=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=12, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, image_dim=16, added_kv_proj_dim=64),
        full=dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120),  # ChronoEdit-14B (Wan 2.1 I2V 14B)
        make_inputs=chronoedit_inputs,
        notes=("eager ok; export ok. Wan image-to-video: latents + mask + image latents on channels, CLIP image "
               "rows attended beside the text. full from memory (Wan 2.1 I2V 14B's sizes).")),
    ZooModel(
        "wan_vace", "WanVACETransformer3DModel",
        tiny=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, vace_layers=[0, 1], vace_in_channels=12),
        full=dict(),  # Wan 2.1 VACE 14B: the class defaults
        make_inputs=wan_vace_inputs,
        notes=("eager ok; export ok. A control branch (VACE blocks on the control video) adding hints into the "
               "main blocks. full: the class defaults (Wan 2.1 VACE 14B).")),
    ZooModel(
        "kandinsky5", "Kandinsky5Transformer3DModel",
        tiny=dict(in_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
                  model_dim=64, ff_dim=128, num_text_blocks=1, num_visual_blocks=2, axes_dims=_ROPE16),
        full=dict(in_visual_dim=16, out_visual_dim=16, model_dim=1792, ff_dim=7168),  # Kandinsky 5.0 Lite, memory
        make_inputs=kandinsky5_inputs,
        notes=("eager ok; export ok. Channels-last latents, a text encoder of its own blocks, self- and "
               "cross-attention over video rows. full from memory (Kandinsky 5.0 Video Lite, uncertain).")),
    ZooModel(
        "easyanimate", "EasyAnimateTransformer3DModel",
        tiny=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2,
                  sample_width=8, sample_height=4, num_layers=2, mmdit_layers=2, time_embed_dim=32, text_embed_dim=32),
        full=dict(in_channels=16, out_channels=16, patch_size=2),  # EasyAnimate V5.1 12B: the class defaults
        make_inputs=easyanimate_inputs,
        notes=("eager ok; export ok. MMDiT video blocks (text and video rows in one joint attention). full: the "
               "class defaults with 16 latent channels (EasyAnimate V5.1 12B, from memory).")),
    ZooModel(
        "hunyuan_video15", "HunyuanVideo15Transformer3DModel",
        tiny=dict(in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                  num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
                  rope_axes_dim=_ROPE16),
        full=dict(),  # HunyuanVideo 1.5 (8.3B): the class defaults
        make_inputs=hunyuan_video15_inputs,
        notes=("eager ok; export refuses a Python branch on whether image_embeds (float) is all zeros: traced for "
               "the example's branch, a guard (value_guards); text rows of three encoders reordered by their masks "
               "(valid first) before a joint attention: traced for the masks. full: the class defaults.")),
    ZooModel(
        "nucleus_moe", "NucleusMoEImageTransformer2DModel",
        # five blocks: the dense strategy keeps the first three and the last dense, so one block routes to experts
        tiny=dict(patch_size=2, in_channels=16, num_layers=5, attention_head_dim=16, num_attention_heads=4,
                  joint_attention_dim=32, axes_dims_rope=(4, 6, 6), num_experts=4, moe_intermediate_dim=32,
                  capacity_factors=2.0),
        full=dict(),  # the class defaults
        make_inputs=qwen_image_inputs,  # its pipeline builds Qwen-Image's inputs
        notes=("eager ok; its mixture-of-experts layer runs each expert on its routed rows, counted per expert with "
               ".tolist() of a tensor of its fixed capacity: the counts are folded at partition time "
               "(hoist_host), exact in every mode.")),
]}


# --- the sizes pipelines pass ---------------------------------------------------------------------------------------

# ``partitioner.frontend.pipeline_sizes.PIPELINE_SIZES`` by zoo name
PIPELINE_SIZES: dict[str, dict[str, dict]] = {name: SIZES_BY_CLASS[m.cls] for name, m in ZOO.items()
                                              if m.cls in SIZES_BY_CLASS}


# --- public helpers --------------------------------------------------------------------------------------------------

def _cls(name: str):
    import diffusers

    return getattr(diffusers, ZOO[name].cls)


def config(name: str, *, full: bool = False) -> dict:
    """``ZOO[name]``'s config with the class defaults filled in, as ``model.config`` would show it: the input
    builders read sizes (patch size, channels, rotary scales) that the zoo's kwargs leave at their defaults."""
    import inspect

    entry = ZOO[name]
    given = entry.full if full else entry.tiny
    if given is None:
        raise InputError(f"{name}: no full-size config known")
    defaults = {k: p.default for k, p in inspect.signature(_cls(name).__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **given}


def build(name: str, *, full: bool = False, device: str | torch.device = "cpu") -> torch.nn.Module:
    """``ZOO[name]`` in eval mode, float32. The tiny model is initialised on the CPU after ``torch.manual_seed(0)``
    (its all-zero parameters drawn at random) and then moved to ``device``, so its weights are the same whichever
    device it lands on. ``full=True`` builds
    the production config under ``torch.device("meta")`` (no memory, shapes only) and ignores ``device``.
    float32 comes from the default dtype during construction rather than a cast: diffusers warns on ``to(dtype)``."""
    entry, cls = ZOO[name], _cls(name)
    if full and entry.full is None:
        raise InputError(f"{name}: no full-size config known")
    if full:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("meta"):
                return cls(**entry.full).eval()
        finally:
            torch.set_default_dtype(previous)
    return seeded(lambda: cls(**entry.tiny)).to(device).eval()


def seeded(construct) -> torch.nn.Module:
    """``construct()`` in float32 after ``torch.manual_seed(0)``, the same on every process: zero-initialised
    parameters (gates, modulations, output layers) drawn at random, so the paths behind them count in the outputs
    compared; parameters a model leaves as ``torch.empty`` (LuminaNext's pad token, NucleusMoE's experts) would hold
    whatever memory each process had, so uninitialised memory is filled (deterministic mode: NaN) and drawn too."""
    previous = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        torch.manual_seed(0)
        model = construct()
        with torch.no_grad():
            for parameter in model.parameters():
                if not parameter.any() or not parameter.isfinite().all():
                    parameter.normal_(std=0.1)
        return model.eval()
    finally:
        torch.set_default_dtype(previous)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def inputs(name: str, seed: int = 0, **sizes) -> tuple[tuple, dict]:
    """(args, kwargs) for the tiny ``build(name)``, on the CPU; ``sizes`` as ``ZOO[name].make_inputs`` names them."""
    return ZOO[name].make_inputs(config(name), seed, **sizes)


# odd lengths for the sequence-parallel layouts: 7 text rows (and H3's 5 text, 15 video, 5 audio rows; ChronoEdit
# takes the last 512 rows as text, as its pipeline pads them, so its odd part is 7 image rows)
_ODD = {"minimax_h3": dict(text=5, video=15, audio=5), "chronoedit": dict(text=512, pad=505, image_rows=7)}


def odd_sizes(name: str) -> dict:
    """``inputs(name, **odd_sizes(name))``: parts of lengths with different remainders over 2 ranks, as pipelines
    pass them (the zoo's defaults are even)."""
    return dict(_ODD.get(name, dict(text=7)))
