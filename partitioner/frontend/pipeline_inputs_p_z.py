"""Input builders for the diffusers transformers of ``testing.catalog`` outside the zoo, PRX to ZImage
(alphabetically), each built the way its pipeline builds what it passes to the model, in the style of
``pipeline_inputs``: ``text`` text rows, ``pad`` of them trailing padding, ``height``/``width``/``frames`` in latent
units before patching."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..errors import InputError
from .pipeline_inputs import _randn, _text_mask, _timestep



def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- PRX -----------------------------------------------------------------------------------------------------------

def prx_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """PRXPipeline: the latent image (1, C, h, w) unpacked (the model patches it itself and builds its own 2-D rotary
    ids), T5-Gemma rows with the tokenizer's bool mask (``attention_mask``), and the timestep as t / 1000 in a
    (1,) float tensor."""
    g = _gen(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    timestep=_timestep(g, 1.0),
                    encoder_hidden_states=_randn(g, 1, text, config["context_in_dim"]),
                    attention_mask=_text_mask(text, pad, torch.bool))


# --- PriorTransformer (Kandinsky 2.x / unCLIP prior) -----------------------------------------------------------------

def prior_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2):
    """KandinskyPriorPipeline (and unCLIP's prior): the noisy CLIP image embedding (1, embedding_dim), the scheduler's
    timestep as a 0-d int64 tensor (UnCLIPScheduler's ``t`` as is), the pooled CLIP text embedding
    (``proj_embedding``), the CLIP text encoder's last hidden state padded to the tokenizer's max length and its bool
    mask. The model's positional table and causal mask have exactly ``num_embeddings`` text rows (77 in the real
    checkpoints), so ``text`` must equal ``config["num_embeddings"]``."""
    n = config.get("num_embeddings", 77)
    if text != n:
        raise InputError(f"prior: text={text}, but PriorTransformer takes exactly num_embeddings={n} text rows "
                         "(the tokenizer pads to its max length); pass text={n} and choose pad")
    g = _gen(seed)
    dim = config.get("embedding_dim", 768)
    clip_dim = config.get("clip_embed_dim") or dim
    proj_dim = config.get("embedding_proj_dim") or dim
    return (), dict(hidden_states=_randn(g, 1, clip_dim),
                    timestep=torch.randint(0, 1000, (), generator=g),
                    proj_embedding=_randn(g, 1, proj_dim),
                    encoder_hidden_states=_randn(g, 1, text, dim),
                    attention_mask=_text_mask(text, pad, torch.bool))


# --- Qwen-Image 2.1 --------------------------------------------------------------------------------------------------

def qwen_image21_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 8,
                        width: int = 8):
    """QwenImage21Pipeline, text-to-image, with ``use_kv_cache=False`` (the default KV-cached path passes a
    ``QwenImage21KVCache`` object and ``kv_cache_mode`` "extract" on step 0 and "cached" after): latents unpatched
    and flattened to (1, h*w, C); Qwen-VL rows; t / 1000 as a (1,) float; ``img_shapes`` a Python list
    [[(1, h, w)]]; ``img_mask`` a (1, text + h*w/4) bool tensor, False on the text slots and True on one slot per 2x2
    group of target latents (the pipeline's ``append_target_slots``). The prompt mask is int64 when the prompt is
    padded and dropped (None) when all ones, as for a single prompt."""
    if height % 2 or width % 2:
        raise InputError(f"qwen_image21: height={height}, width={width} must be even (one VL slot per 2x2 latents)")
    g = _gen(seed)
    img_mask = torch.cat([torch.zeros(1, text, dtype=torch.bool), torch.ones(1, height * width // 4, dtype=torch.bool)],
                         dim=1)
    return (), dict(hidden_states=_randn(g, 1, height * width, config["in_channels"]),
                    timestep=_timestep(g, 1.0),
                    encoder_hidden_states=_randn(g, 1, text, config["context_in_dim"]),
                    encoder_hidden_states_mask=_text_mask(text, pad, torch.int64) if pad else None,
                    img_shapes=[[(1, height, width)]], img_mask=img_mask)


# --- RFD4-Proteina ---------------------------------------------------------------------------------------------------

def rfd4_proteina_inputs(config: dict, seed: int = 0, *, tokens: int = 12, pad: int = 2, recycle: int = 1):
    """RFD4ProteinaPipeline (a protein-design denoiser, no text): noisy backbone CA coordinates (1, N, 3) and local
    latents (1, N, latent_dim), both zeroed on padding tokens, the two modality times in [0, 1] as (1,) floats, a
    bool padding mask, int token types, a bool atom37 mask, and the ``conditioning`` dict of prepared feature tensors
    (the keys the checkpoint's default features read and the pipeline requires: the six atom-interaction
    annotations, molecule / entity / index-group ids, the token bond path lengths, the sequence condition, and the
    pipeline's own ``is_in_context_conditioning`` / ``supports_local_latent`` masks). ``recycle_depth`` is a Python
    int (the released schedule passes 6 down to 1 trunk passes per step)."""
    from diffusers.models.transformers.transformer_rfd4_proteina import CONDITION_KEYS

    if not 0 <= pad < tokens:
        raise InputError(f"pad={pad} must leave at least one of tokens={tokens}")
    g = _gen(seed)
    n = tokens
    padding = torch.ones(1, n, dtype=torch.bool)
    padding[:, n - pad:] = False
    atom37 = (torch.rand(1, n, 37, generator=g) < 0.5) & padding[..., None]
    atom37[..., :4] = padding[..., None]  # backbone atoms present on every real token
    in_context = torch.zeros(1, n, dtype=torch.bool)
    bb_mask = (padding & ~in_context).float()[..., None]

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    conditioning = {
        CONDITION_KEYS["sequence"]: ints(20, 1, n),
        "molecule_iid": torch.zeros(1, n, dtype=torch.long),
        "molecule_entity_id": torch.zeros(1, n, dtype=torch.long),
        CONDITION_KEYS["index_group"]: ints(2, 1, n),
        "token_bond_path_length": (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()[None],
        CONDITION_KEYS["hbond"]: ints(4, 1, n, 37),
        CONDITION_KEYS["pistack"]: ints(2, 1, n, 37),
        CONDITION_KEYS["pication"]: ints(4, 1, n, 37),
        CONDITION_KEYS["saltbridge"]: ints(2, 1, n, 37),
        CONDITION_KEYS["hydrophobic"]: ints(2, 1, n, 37),
        CONDITION_KEYS["metal_coord"]: ints(2, 1, n, 37),
        "is_in_context_conditioning": in_context,
        "supports_local_latent": padding.clone(),
    }
    return (), dict(bb_ca=_randn(g, 1, n, 3) * bb_mask,
                    local_latents=_randn(g, 1, n, config["latent_dim"]) * bb_mask,
                    bb_ca_time=torch.rand(1, generator=g), local_latents_time=torch.rand(1, generator=g),
                    padding_mask=padding, token_type=torch.zeros(1, n, dtype=torch.long), atom37_mask=atom37,
                    conditioning=conditioning, recycle_depth=recycle)


# --- Sana-Video ------------------------------------------------------------------------------------------------------

def sana_video_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                      width: int = 8):
    """SanaVideoPipeline: latent video (1, C, f, h, w), Gemma rows with their int64 mask, the flow-matching
    timestep t in [0, 1000) as a (1,) float (no timestep scaling, no guidance embedding)."""
    g = _gen(seed)
    kwargs = dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width),
                  encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.int64), timestep=_timestep(g))
    if config.get("guidance_embeds"):
        kwargs["guidance"] = torch.full([1], 4.5)
    return (), kwargs


# --- SANA-WM (stage 1) -----------------------------------------------------------------------------------------------

def sana_wm_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 3, height: int = 4,
                   width: int = 6):
    """SanaWMPipeline (camera-controlled image-to-video, stage 1): latents (1, C, f, h, w) with the first frame the
    clean image latent; LTX-style per-frame timesteps (1, 1, f), 0 on the first (conditioning) frame and t in
    [0, 1000) on the rest; Gemma rows as (1, 1, L, D) with their int64 mask passed as ``mask``; ``data_info`` a dict
    holding ``img_hw`` (1, 2) float pixels; and the camera tensors the pipeline's ``prepare_camera`` builds from a
    camera path and intrinsics (LTX-2 VAE strides 8/32/32): ``camera_conditions`` (1, f, 20) raymap and
    ``chunk_plucker`` (1, 48, f, h, w) Pluecker rays."""
    from diffusers.pipelines.sana_wm.cam_utils import prepare_camera

    g = _gen(seed)
    stride_t, stride_s = 8, 32
    num_frames, hp, wp = (frames - 1) * stride_t + 1, height * stride_s, width * stride_s
    c2w = torch.eye(4).repeat(num_frames, 1, 1)
    c2w[:, :3, 3] = torch.cumsum(torch.randn(num_frames, 3, generator=g) * 0.05, dim=0)
    intr = torch.tensor([[wp * 0.8, wp * 0.8, wp / 2, hp / 2]]).repeat(num_frames, 1)
    cam = prepare_camera(c2w.numpy(), intr.numpy(), target_size=(hp, wp), vae_stride=(stride_t, stride_s, stride_s))
    timestep = torch.full((1, 1, frames), float(_timestep(g)))
    timestep[:, :, 0] = 0.0
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=timestep,
                    encoder_hidden_states=_randn(g, 1, 1, text, config["caption_channels"]),
                    mask=_text_mask(text, pad, torch.int64),
                    data_info={"img_hw": torch.tensor([[float(hp), float(wp)]])},
                    camera_conditions=cam["raymap"][None], chunk_plucker=cam["chunk_plucker"][None])


# --- SANA-WM stage 2: the LTX-2 refiner ------------------------------------------------------------------------------

def _refiner_rotary(config: dict, frame_positions: list[int], height: int, width: int, fps: float):
    """The refiner's ``build_rotary_emb_for_absolute_positions`` without building the model: same rope module."""
    from diffusers.models.transformers.transformer_sana_wm_refiner import (
        SanaWMLTX2AudioVideoRotaryPosEmbed, SanaWMLTX2RefinerTransformer3DModel)

    heads = config.get("num_attention_heads", 32)
    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=heads * config.get("attention_head_dim", 128), patch_size=config.get("patch_size", 1),
        patch_size_t=config.get("patch_size_t", 1), base_num_frames=config.get("pos_embed_max_pos", 20),
        base_height=config.get("base_height", 2048), base_width=config.get("base_width", 2048),
        scale_factors=tuple(config.get("vae_scale_factors", (8, 32, 32))), theta=config.get("rope_theta", 10000.0),
        causal_offset=config.get("causal_offset", 1), modality="video",
        double_precision=config.get("rope_double_precision", True), rope_type=config.get("rope_type", "interleaved"),
        num_attention_heads=heads)
    return SanaWMLTX2RefinerTransformer3DModel.build_rotary_emb_for_absolute_positions(
        SimpleNamespace(rope=rope), batch_size=1, frame_positions=frame_positions, height=height, width=width,
        device=torch.device("cpu"), fps=fps)


def sana_wm_refiner_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 3, height: int = 4,
                           width: int = 4, sink: int = 1, history: int = 2, fps: float = 16.0, cache: bool = True):
    """SanaWMLTX2Refiner (SANA-WM stage 2), one denoising step of one AR block: the block's latents packed to
    (1, f*h*w, C); LTX-2 connector rows with their int64 mask (all ones: the connector's registers fill the padding);
    a per-token timestep (1, f*h*w) = sigma * 1000 (sigma from the distilled 3-step schedule); the video rotary
    (cos, sin) for the block's absolute frame positions (``build_rotary_emb_for_absolute_positions``, fps 16); and,
    with ``cache=True`` (as the pipeline always runs), a ``SanaWMRefinerKVCache`` object with ``kv_cache_mode=
    "inject"``: per layer a pre-RoPE sink of ``sink`` frames and a post-RoPE history of ``history`` frames (random
    K/V standing in for the captured ones) plus the sink's rotary at its sliding offset. ``cache=False`` passes no
    cache (plain self-attention over the block)."""
    g = _gen(seed)
    hw = height * width // config.get("patch_size", 1) ** 2
    seq = frames * hw // config.get("patch_size_t", 1)
    start = sink + history
    sigma = float((0.909375, 0.725, 0.421875)[int(torch.randint(0, 3, (1,), generator=g))])
    kwargs = dict(hidden_states=_randn(g, 1, seq, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                  timestep=torch.full((1, seq), sigma * config.get("timestep_scale_multiplier", 1000)),
                  video_rotary_emb=_refiner_rotary(config, list(range(start, start + frames)), height, width, fps),
                  encoder_attention_mask=torch.ones(1, text, dtype=torch.int64))
    if cache:
        from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache

        inner = config["num_attention_heads"] * config["attention_head_dim"]
        kv = SanaWMRefinerKVCache(config["num_layers"])
        for i in range(config["num_layers"]):
            layer = kv.get(i)
            layer.store_sink(_randn(g, 1, sink * hw, inner), _randn(g, 1, sink * hw, inner))
            if history:
                layer.store_history(_randn(g, 1, history * hw, inner), _randn(g, 1, history * hw, inner))
        kv.sink_pe = _refiner_rotary(config, list(range(0, sink)), height, width, fps)  # offset start-history-sink=0
        kwargs.update(kv_cache=kv, kv_cache_mode="inject")
    return (), kwargs


# --- Stable Audio 3 --------------------------------------------------------------------------------------------------

def stable_audio3_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, length: int = 16):
    """StableAudio3Pipeline: latent audio (1, io_channels, length); the rectified-flow timestep in [0, 1] as a (1,)
    float; the cross-attention context = T5 rows (tokenizer-padded) followed by one duration token (the duration
    embedder's output, also passed as ``global_hidden_states`` (1, global_cond_dim)), with the int64 tokenizer mask
    extended by a 1 for the duration token (the model swaps masked rows for a learned padding embedding)."""
    g = _gen(seed)
    duration = _randn(g, 1, config["global_cond_dim"])
    context = torch.cat([_randn(g, 1, text, config["cond_token_dim"]), duration[:, None]], dim=1)
    mask = torch.cat([_text_mask(text, pad, torch.int64), torch.ones(1, 1, dtype=torch.int64)], dim=1)
    return (_randn(g, 1, config["io_channels"], length), _timestep(g, 1.0)), dict(
        encoder_hidden_states=context, global_hidden_states=duration, encoder_attention_mask=mask)


# --- Stable Audio Open (v1) ------------------------------------------------------------------------------------------

def stable_audio_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, length: int = 16):
    """StableAudioPipeline: latent audio (1, C, length); the cosine-DPM timestep (in [0, 1)) as a (1,) float; the
    cross-attention rows = projected T5 rows with padding rows zeroed (no mask is passed) followed by the
    seconds-start and seconds-end tokens; ``global_hidden_states`` (1, 1, 2 * D) those two tokens concatenated on
    channels; and the pipeline's rotary table ``get_1d_rotary_pos_embed(head_dim // 2, length + 1, use_real=True,
    repeat_interleave_real=False)`` as a (cos, sin) tuple."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    g = _gen(seed)
    dim = config["cross_attention_input_dim"]
    prompt = _randn(g, 1, text, dim) * _text_mask(text, pad, torch.float32)[..., None]
    start, end = _randn(g, 1, 1, dim), _randn(g, 1, 1, dim)
    rotary = get_1d_rotary_pos_embed(config["attention_head_dim"] // 2, length + 1, use_real=True,
                                     repeat_interleave_real=False)
    return (_randn(g, 1, config["in_channels"], length), _timestep(g, 1.0)), dict(
        encoder_hidden_states=torch.cat([prompt, start, end], dim=1),
        global_hidden_states=torch.cat([start, end], dim=2), rotary_embedding=rotary)


# --- SpectrogramDiffusion's decoder ----------------------------------------------------------------------------------

def t5_film_decoder_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 16,
                           first_chunk: bool = False):
    """SpectrogramDiffusionPipeline.decode: ``encodings_and_masks``, a Python list of two (encoding, bool mask)
    tuples: the notes encoder's rows (``text`` note tokens, the last ``pad`` padding, mask = tokens > 0) and the
    continuous encoder's rows (the previous chunk's mel frames; its mask is all False on the first chunk and all True
    after); the noisy mel frames (1, frames, input_dims); and the noise time t / 1000 as a (1,) float. The pipeline
    always decodes ``targets_length`` (256) frames; ``frames`` must not exceed it."""
    if frames > config.get("targets_length", 256):
        raise InputError(f"t5_film_decoder: frames={frames} > targets_length={config.get('targets_length', 256)}")
    g = _gen(seed)
    d = config.get("d_model", 768)
    continuous_mask = (torch.zeros if first_chunk else torch.ones)(1, frames, dtype=torch.bool)
    encodings = [(_randn(g, 1, text, d), _text_mask(text, pad, torch.bool)), (_randn(g, 1, frames, d), continuous_mask)]
    return (), dict(encodings_and_masks=encodings,
                    decoder_input_tokens=_randn(g, 1, frames, config.get("input_dims", 128)),
                    decoder_noise_time=torch.randint(0, 1000, (1,), generator=g) / 1000)


# --- Transformer2DModel, as PixArt-alpha's transformer ---------------------------------------------------------------

def transformer_2d_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8,
                          width: int = 8):
    """PixArtAlphaPipeline with the original PixArt-XL-2-1024 ``Transformer2DModel`` (ada_norm_single): latent image,
    T5 rows with their int64 mask, an int64 (1,) timestep, and ``added_cond_kwargs`` {"resolution": (1, 2) pixel
    height/width, "aspect_ratio": (1, 1)} as the pipeline builds them for the 1024 model (it keys this on
    sample_size == 128; the tiny config sets ``use_additional_conditions``), else both None."""
    g = _gen(seed)
    if config.get("use_additional_conditions") or config.get("sample_size") == 128:
        added = {"resolution": torch.tensor([[height * 8.0, width * 8.0]]),
                 "aspect_ratio": torch.tensor([[float(height / width)]])}
    else:
        added = {"resolution": None, "aspect_ratio": None}
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                    encoder_attention_mask=_text_mask(text, pad, torch.int64),
                    timestep=torch.randint(0, 1000, (1,), generator=g), added_cond_kwargs=added)


# --- TransformerTemporalModel, as UNet3DConditionModel's temporal transformer -----------------------------------------

def transformer_temporal_inputs(config: dict, seed: int = 0, *, frames: int = 4, height: int = 4, width: int = 4):
    """UNet3DConditionModel (TextToVideoSDPipeline) calls ``transformer_in`` / the blocks' ``temp_attentions`` with the
    feature map (batch * frames, C, h, w) and ``num_frames`` as a Python int; no text (``double_self_attention``:
    both attentions attend over frames), no timestep."""
    g = _gen(seed)
    return (_randn(g, frames, config["in_channels"], height, width),), dict(num_frames=frames)


# --- Wan-Animate -----------------------------------------------------------------------------------------------------

def wan_animate_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                       width: int = 8, image_rows: int = 5):
    """WanAnimatePipeline ("animate" mode, first segment): the noisy latents (1, Cl, f + 1, h, w) concatenated on
    channels with the reference latents (the character image's latents behind an all-ones 4-channel mask, then the
    previous-segment conditioning latents behind an all-zeros mask: one frame + f frames); the pose video's latents
    (1, Cl, f, h, w); the face video in pixels (1, 3, 4(f-1)+1, S, S) in [-1, 1] at S = motion_encoder_size; CLIP
    image rows; T5 rows with padding rows zeroed (no mask); an int64 (1,) UniPC timestep; and
    ``motion_encode_batch_size`` None (the pipeline's default)."""
    g = _gen(seed)
    lc = config.get("latent_channels") or (config["in_channels"] - 4) // 2
    ref_image = torch.cat([torch.ones(1, 4, 1, height, width), _randn(g, 1, lc, 1, height, width)], dim=1)
    prev_segment = torch.cat([torch.zeros(1, 4, frames, height, width), _randn(g, 1, lc, frames, height, width)], dim=1)
    reference = torch.cat([ref_image, prev_segment], dim=2)
    latents = torch.cat([_randn(g, 1, lc, frames + 1, height, width), reference], dim=1)
    size = config.get("motion_encoder_size", 512)
    face = torch.rand(1, 3, 4 * (frames - 1) + 1, size, size, generator=g) * 2 - 1
    prompt = _randn(g, 1, text, config["text_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=latents, timestep=torch.randint(0, 1000, (1,), generator=g),
                    encoder_hidden_states=prompt,
                    encoder_hidden_states_image=_randn(g, 1, image_rows, config["image_dim"]),
                    pose_hidden_states=_randn(g, 1, lc, frames, height, width), face_pixel_values=face,
                    motion_encode_batch_size=None)


# --- Wan-Animate 2 (modular pipeline), reference pass ----------------------------------------------------------------

def wan_animate2_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 2, height: int = 4,
                        width: int = 8, image_rows: int = 5):
    """WanAnimate2 modular pipeline's reference pass (``WanAnimate2SegmentReferenceStep``: ``kv_cache_mode=
    "extract"``, once per segment): Python lists of one un-batched tensor each: the driving video's latents
    (16, f, h, w), its condition (an all-ones 4-channel i2v mask + the latents, (20, f, h, w)), the T5 rows trimmed
    to the prompt's length (the model zero-pads them to ``text_len``); a (1,) float timestep (ignored in this mode);
    CLIP image rows (1, rows, 1280); a fresh ``WanAnimate2KVCache`` object the pass fills; ``seq_len`` a Python int
    (f * h/2 * w/2); and ``offset_grid_sizes`` int64 [[f, h/2, w/2]]. The denoising passes (``"cached"``) need the
    flex-attention backend under torch.compile and are not built here."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    if text > config.get("text_len", 512):
        raise InputError(f"wan_animate2: text={text} > text_len={config.get('text_len', 512)}")
    g = _gen(seed)
    _, ph, pw = config.get("patch_size", (1, 2, 2))
    lc = config.get("out_dim", 16)
    latents = _randn(g, lc, frames, height, width)
    condition = torch.cat([torch.ones(config.get("in_dim", 36) - 2 * lc, frames, height, width), latents.clone()])
    grid = [frames, height // ph, width // pw]
    return (), dict(hidden_states=[latents], timestep=_timestep(g),
                    encoder_hidden_states=[_randn(g, text, config.get("text_dim", 4096))],
                    condition_latents=[condition], kv_cache=WanAnimate2KVCache(config.get("num_layers", 40)),
                    kv_cache_mode="extract", seq_len=math.prod(grid),
                    encoder_hidden_states_image=_randn(g, 1, image_rows, 1280),
                    offset_grid_sizes=torch.tensor([grid], dtype=torch.long))


# --- Z-Image ---------------------------------------------------------------------------------------------------------

def z_image_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """ZImagePipeline: Python lists with one un-batched tensor each: the latent image as (C, 1, h, w) and the Qwen3
    rows already trimmed to the prompt's valid tokens (``prompt_embeds[i][prompt_masks[i]]``, so no mask and no
    padding), and the timestep (1000 - t) / 1000 as a (1,) float."""
    g = _gen(seed)
    return ([_randn(g, config["in_channels"], 1, height, width)], 1.0 - _timestep(g, 1.0),
            [_randn(g, text, config["cap_feat_dim"])]), {}


# --- tiny configs ----------------------------------------------------------------------------------------------------


BUILDERS = {  # diffusers class name -> its input builder
    "PRXTransformer2DModel": prx_inputs,
    "PriorTransformer": prior_inputs,
    "QwenImage21Transformer2DModel": qwen_image21_inputs,
    "RFD4ProteinaTransformer": rfd4_proteina_inputs,
    "SanaVideoTransformer3DModel": sana_video_inputs,
    "SanaWMLTX2RefinerTransformer3DModel": sana_wm_refiner_inputs,
    "SanaWMTransformer3DModel": sana_wm_inputs,
    "StableAudio3DiTModel": stable_audio3_inputs,
    "StableAudioDiTModel": stable_audio_inputs,
    "T5FilmDecoder": t5_film_decoder_inputs,
    "Transformer2DModel": transformer_2d_inputs,
    "TransformerTemporalModel": transformer_temporal_inputs,
    "WanAnimate2Transformer3DModel": wan_animate2_inputs,
    "WanAnimateTransformer3DModel": wan_animate_inputs,
    "ZImageTransformer2DModel": z_image_inputs,
}
