"""Input builders for the diffusers transformers of ``testing.catalog`` outside the zoo, AceStep to HunyuanImage
(alphabetically), each built the way its pipeline builds what it passes to the model, in the style of
``pipeline_inputs``: ``text`` text rows, ``pad`` of them trailing padding, ``height``/``width``/``frames`` in latent
units before patching."""

from __future__ import annotations

import torch

from ..errors import InputError
from .pipeline_inputs import _flux_ids, _randn, _text_mask, _timestep, cogvideox_rotary



# --- builders -------------------------------------------------------------------------------------------------------

def ace_step_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 10):
    """AceStepPipeline: noise latents (1, T, acoustic_dim), context_latents = the source latents
    (silence latent for text-to-music) concatenated on channels with the chunk mask (ones for full generation),
    the condition encoder's packed text + lyric + timbre rows (no mask passed), and the flow time t in [0, 1]
    (scheduler with num_train_timesteps=1) passed both as ``timestep`` and ``timestep_r``."""
    g = torch.Generator().manual_seed(seed)
    dim = config["audio_acoustic_hidden_dim"]
    t = _timestep(g, 1.0)
    context = torch.cat([_randn(g, 1, frames, dim), torch.ones(1, frames, dim)], dim=-1)  # in_channels = 3 * dim
    return (), dict(hidden_states=_randn(g, 1, frames, dim), timestep=t, timestep_r=t.clone(),
                    encoder_hidden_states=_randn(g, 1, text, config["encoder_hidden_size"] or config["hidden_size"]),
                    context_latents=context)


def _wan_prompt(g: torch.Generator, text: int, pad: int, dim: int) -> torch.Tensor:
    """Wan-style T5 rows: padded to max_sequence_length with the padding rows zeroed (no mask is passed)."""
    return _randn(g, 1, text, dim) * _text_mask(text, pad, torch.float32)[..., None]


def anyflow_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                   width: int = 8):
    """AnyFlowPipeline: frame-major latents (1, F, C, h, w) (the pipeline permutes Wan's (B, C, F, h, w)), UMT5
    rows with the padding rows zeroed (Wan's prompt encoding, no mask), and the flow-map pair as per-frame float
    tensors (1, F): ``timestep`` = the scheduler's t in [0, 1000) and ``r_timestep`` = the next sigma * 1000 (< t,
    ``use_mean_velocity=True``)."""
    g = torch.Generator().manual_seed(seed)
    t = _timestep(g) + 1.0
    r = t * torch.rand(1, generator=g)
    return (), dict(hidden_states=_randn(g, 1, frames, config["in_channels"], height, width),
                    timestep=t.expand(1, frames).clone(), r_timestep=r.expand(1, frames).clone(),
                    encoder_hidden_states=_wan_prompt(g, text, pad, config["text_dim"]))


def anyflow_far_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, chunk: int = 2,
                       height: int = 4, width: int = 8):
    """AnyFlowFARPipeline, one denoising step of chunk ``chunk`` (0-based) of ``config["chunk_partition"]``: that
    chunk's frame-major latents (1, F_chunk, C, h, w), per-frame t and r (1, F_chunk) as AnyFlowPipeline, UMT5 rows
    with padding zeroed, ``chunk_partition`` = the Python list of chunk frame counts up to this chunk, the KV cache
    the pipeline allocates (a dict layer -> {"full_cache", "compressed_cache"} of (2, 1, heads, rows, head_dim)
    tensors; filled with random values standing in for the earlier chunks' prefilled keys/values) and
    ``kv_cache_flag`` = {"num_cached_chunks": chunk, "is_cache_step": False} (a fresh dict: the pipeline passes a
    deepcopy, the model writes token counts into it). The model returns (noise_pred, kv_cache)."""
    g = torch.Generator().manual_seed(seed)
    partition = list(config["chunk_partition"])
    if not 0 <= chunk < len(partition):
        raise InputError(f"chunk={chunk} outside chunk_partition={partition}")
    p, cp = config["patch_size"], config["compressed_patch_size"]
    full_tpf = (height // p[1]) * (width // p[2])
    compressed_tpf = (height // cp[1]) * (width // cp[2])
    heads, dim, limit = config["num_attention_heads"], config["attention_head_dim"], config["full_chunk_limit"]
    kv_cache = {layer: {"full_cache": _randn(g, 2, 1, heads, limit * max(partition) * full_tpf, dim),
                        "compressed_cache": _randn(g, 2, 1, heads, (len(partition) - limit + 1) * max(partition)
                                                   * compressed_tpf, dim)}
                for layer in range(config["num_layers"])}
    frames = partition[chunk]
    t = _timestep(g) + 1.0
    r = t * torch.rand(1, generator=g)
    return (), dict(hidden_states=_randn(g, 1, frames, config["in_channels"], height, width),
                    timestep=t.expand(1, frames).clone(), r_timestep=r.expand(1, frames).clone(),
                    encoder_hidden_states=_wan_prompt(g, text, pad, config["text_dim"]),
                    chunk_partition=partition[:chunk + 1], kv_cache=kv_cache,
                    kv_cache_flag={"num_cached_chunks": chunk, "is_cache_step": False})


def bria_fibo_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 4, width: int = 4):
    """BriaFiboPipeline (do_patching=False): latents packed without 2x2 patching to (1, h*w, in_channels),
    SmolLM3 rows = cat(last, second-to-last hidden layer) (joint_attention_dim), ``text_encoder_layers`` = a Python
    list of one (1, text, text_encoder_dim) hidden layer per block (num_layers + num_single_layers; the encoder's
    last layers), zero txt_ids (text, 3) and Flux image ids (h*w, 3) with the batch dim dropped, t in [0, 1000).
    A single prompt is tokenized to its own length (no mask); with ``pad`` > 0 (the CFG batch pads the shorter prompt)
    the padding rows are zero and the bool key mask over text + image rows (1, 1, 1, text + h*w) goes in
    ``joint_attention_kwargs["attention_mask"]``, as the pipeline does."""
    g = torch.Generator().manual_seed(seed)
    keep = _text_mask(text, pad, torch.float32)[..., None]
    layers = [_randn(g, 1, text, config["text_encoder_dim"]) * keep
              for _ in range(config["num_layers"] + config["num_single_layers"])]
    kwargs = dict(hidden_states=_randn(g, 1, height * width, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]) * keep,
                  text_encoder_layers=layers, timestep=_timestep(g), txt_ids=torch.zeros(text, 3),
                  img_ids=_flux_ids(height, width))
    if pad:
        mask = torch.cat([_text_mask(text, pad, torch.bool), torch.ones(1, height * width, dtype=torch.bool)], 1)
        kwargs["joint_attention_kwargs"] = {"attention_mask": mask[:, None, None, :]}
    return (), kwargs


def bria_fibo2_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8,
                      images: int = 0):
    """BriaFibo2Pipeline: latents (1, in_channels, h, w) (the model patchifies), the noise level t/1000 in [0, 1],
    the Qwen3-VL text as stacked bundles (1, 1 + len(injection_layer_ids), text, cap_feat_dim) (each bundle three
    RMS-normalised hidden layers concatenated: the Perceiver's first, then one per injection block), no mask (a single
    prompt is never padded: the pipeline drops an all-ones mask; a mask would be read with ``.tolist()`` to count
    gist tokens), and ``context_latents`` = a Python list of ``images`` image-to-edit latents (None for
    text-to-image)."""
    g = torch.Generator().manual_seed(seed)
    bundles = 1 + len(config["injection_layer_ids"])
    context = [_randn(g, 1, config["in_channels"], height, width) for _ in range(images)] or None
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width), timestep=_timestep(g, 1.0),
                    encoder_hidden_states=_randn(g, 1, bundles, text, config["cap_feat_dim"]),
                    context_latents=context)


def cogview3plus_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """CogView3PlusPipeline: latent image (1, C, h, w), T5 rows padded to max_length (no mask: the padding rows are
    the encoder's outputs for pad tokens), the DDIM/DPM scheduler's int64 timestep, and SDXL-style micro-conditions
    as float (1, 2) tensors: original_size = target_size = the pixel size (h * 8, w * 8), crop coords (0, 0)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([[height * 8.0, width * 8.0]])
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                    timestep=torch.randint(0, 1000, (1,), generator=g), original_size=size,
                    target_size=size.clone(), crop_coords=torch.zeros(1, 2))


def consisid_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 2, height: int = 4, width: int = 4,
                    vit_rows: int = 5):
    """ConsisIDPipeline (identity-preserving image-to-video, CogVideoX-based): frame-major latents (1, F, C, h, w)
    concatenated on channels with the image latents (the face image's latent in frame 0, zeros after), T5 rows
    (no mask), the int64 scheduler timestep, CogVideoX 1.0's rotary (cos, sin) table the pipeline computes, and the
    face embeddings: ``id_cond`` (1, LFE_id_dim) (insightface + CLIP id embedding) and ``id_vit_hidden`` = a Python
    list of LFE_num_scale EVA-CLIP hidden states (1, vit_rows, LFE_vit_dim) (577 rows in the real model)."""
    g = torch.Generator().manual_seed(seed)
    channels = config["in_channels"] // 2
    image = torch.zeros(1, frames, channels, height, width)
    image[:, :1] = _randn(g, 1, 1, channels, height, width)
    latents = torch.cat([_randn(g, 1, frames, channels, height, width), image], dim=2)
    kwargs = dict(hidden_states=latents, encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  timestep=torch.randint(0, 1000, (1,), generator=g))
    if config.get("use_rotary_positional_embeddings"):
        kwargs["image_rotary_emb"] = cogvideox_rotary(config, frames, height, width)
    if config.get("is_train_face"):
        kwargs["id_cond"] = _randn(g, 1, config["LFE_id_dim"])
        kwargs["id_vit_hidden"] = [_randn(g, 1, vit_rows, config["LFE_vit_dim"])
                                   for _ in range(config["LFE_num_scale"])]
    return (), kwargs


def cosmos3_omni_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 2, height: int = 4,
                        width: int = 4, image: bool = False, fps: float = 24.0):
    """Cosmos3OmniPipeline (text/image-to-video, no sound or action): one packed 1-D joint sequence, text rows
    first (the causal "understanding" prefix, ``und_len`` = text) then the video's patch rows. Passes the prompt's
    int64 token ids with their int64 positions ``text_indexes``, the (3, seq) float mRoPE position ids (text: one
    running index on all three axes; video: fps-modulated time after a 15000 margin, spatial ids reset), Python ints
    ``und_len`` and ``sequence_length``, ``vision_tokens`` = a Python list holding the (1, C, F, h, w) latents,
    ``vision_token_shapes`` = [(F, h/p, w/p)] (Python tuples), int64 ``vision_sequence_indexes`` and
    ``vision_mse_loss_indexes`` (the rows of the noisy frames), ``vision_noisy_frame_indexes`` = [int64 frame
    indices] (frame 0 is dropped when ``image``: image-to-video conditions on it), and ``vision_timesteps`` = the
    UniPC scheduler's int64 t in [0, 1000) repeated over the noisy rows. The model returns three lists."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (get_3d_mrope_ids_text_tokens,
                                                                  get_3d_mrope_ids_vae_tokens)

    if image and frames < 2:
        raise InputError("cosmos3_omni: image-to-video conditions on frame 0, so it needs frames >= 2")
    g = torch.Generator().manual_seed(seed)
    p = config["latent_patch_size"]
    ph, pw = -(-height // p), -(-width // p)
    text_ids, offset = get_3d_mrope_ids_text_tokens(num_tokens=text, temporal_offset=0,
                                                    use_float_positions=config["enable_fps_modulation"])
    offset = offset + config["unified_3d_mrope_temporal_modality_margin"]
    vision_ids, _ = get_3d_mrope_ids_vae_tokens(
        grid_t=frames, grid_h=ph, grid_w=pw, temporal_offset=offset,
        reset_spatial_indices=config["unified_3d_mrope_reset_spatial_ids"],
        fps=fps if config["enable_fps_modulation"] else None, base_fps=float(config["base_fps"]),
        temporal_compression_factor=4)
    noisy = torch.tensor([f for f in range(frames) if not (image and f == 0)], dtype=torch.long)
    stride = ph * pw
    mse = torch.cat([torch.arange(text + f * stride, text + (f + 1) * stride) for f in noisy.tolist()])
    t = int(torch.randint(0, 1000, (1,), generator=g))
    return (), dict(input_ids=torch.randint(0, config["vocab_size"], (text,), generator=g),
                    text_indexes=torch.arange(text), position_ids=torch.cat([text_ids, vision_ids], dim=1),
                    und_len=text, sequence_length=text + frames * stride,
                    vision_tokens=[_randn(g, 1, config["latent_channel"], frames, height, width)],
                    vision_token_shapes=[(frames, ph, pw)],
                    vision_sequence_indexes=torch.arange(text, text + frames * stride),
                    vision_mse_loss_indexes=mse, vision_timesteps=torch.full((len(noisy) * stride,), t),
                    vision_noisy_frame_indexes=[noisy])


def cosmos_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                  width: int = 4, fps: int = 30):
    """CosmosTextToWorldPipeline (Cosmos 1.0, the class defaults): latent video (1, C, F, h, w) (EDM-scaled; the
    scale doesn't change shapes), T5 rows padded to max_sequence_length with the padding rows zeroed (no mask
    passed), the EDM timestep c_noise = 0.25 * log(sigma), sigma in [0.002, 80], an all-zero ``padding_mask``
    (1, 1, H, W) at pixel size (8x the latent; the model resizes it nearest to the latent size), and ``fps`` as a
    Python int (it scales the temporal rotary positions)."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.exp(torch.empty(1).uniform_(-6.2, 4.38, generator=g))
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width),
                    timestep=0.25 * torch.log(sigma),
                    encoder_hidden_states=_wan_prompt(g, text, pad, config["text_embed_dim"]), fps=fps,
                    padding_mask=torch.zeros(1, 1, height * 8, width * 8))


def dit_inputs(config: dict, seed: int = 0, *, height: int = 8, width: int = 8):
    """DiTPipeline (class-conditional, no text): latent image (1, C, h, w), the DDIM/DPM scheduler's int64 timestep
    expanded to the batch, and int64 ImageNet class labels (1,) in [0, num_embeds_ada_norm) (the CFG half would
    carry the null class num_embeds_ada_norm)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    timestep=torch.randint(0, 1000, (1,), generator=g),
                    class_labels=torch.randint(0, config["num_embeds_ada_norm"], (1,), generator=g))


def dreamlite_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """No pipeline calls this class directly: DreamLitePipeline calls DreamLiteUNetModel, whose cross-attention
    down/mid/up blocks call it (like Transformer2DModel inside UNet2DConditionModel). Built as the UNet passes it:
    a UNet feature map (1, in_channels, h, w), the Qwen prompt rows after the UNet's ``encoder_hid_proj``
    (1, text, cross_attention_dim), and the prompt mask turned by the UNet into an additive float bias
    (1 - mask) * -10000 of shape (1, 1, text); no timestep, no self-attention mask. ``pad`` trailing rows masked
    (a single prompt has none; the CFG batch pads the shorter prompt)."""
    g = torch.Generator().manual_seed(seed)
    bias = (1 - _text_mask(text, pad, torch.float32)) * -10000.0
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["cross_attention_dim"]),
                    encoder_attention_mask=bias[:, None, :])


def ernie_image_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 8,
                       width: int = 8):
    """ErnieImagePipeline: latents (1, in_channels, h, w) (already patchified channels), t in [0, 1000) as a float
    (1,) tensor, ``text_bth`` = the text encoder rows right-padded with zeros to the batch's longest (1, text,
    text_in_dim), and ``text_lens`` = int64 (1,) true lengths (text - pad; a single prompt has pad 0); the model
    builds its own ids and the key mask from ``text_lens``."""
    g = torch.Generator().manual_seed(seed)
    rows = _randn(g, 1, text, config["text_in_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width), timestep=_timestep(g),
                    text_bth=rows, text_lens=torch.tensor([text - pad]))


def _flux3_image_ids(height: int, width: int, l_coord: int = 0, scale: float = 0.5) -> torch.Tensor:
    """Flux3 modular pipeline's _prepare_image_ids: (h*w, 4) float (t=0, row*0.5, col*0.5, l)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width),
                               torch.tensor([l_coord])).to(torch.float32)
    ids[:, 1:3] = ids[:, 1:3] * scale
    return ids


def flux3_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 4, width: int = 4, images: int = 0):
    """Flux3ModularPipeline / Flux3DistilledModularPipeline (no classic pipeline): latents on the 2x2-packed
    (H/16, W/16) grid flattened to tokens (1, h*w, in_channels), Qwen3-VL rows (several hidden layers stacked on
    channels, joint_attention_dim), right-padded to a multiple of the pad length and attended with no mask, t/1000,
    float position ids without a batch dim: img_ids (h*w, 4) = (0, row*0.5, col*0.5, 0) (image_rope_scale 0.5),
    txt_ids (text, 4) = (0, 0, 0, i); for image-to-image ``images`` reference images' tokens concatenated
    (1, images*h*w, cond_in_channels) with ids l = -1, -2, ...; a flow-map (distilled) config also gets
    ``target_timestep`` = the next timestep / 1000 (< t)."""
    g = torch.Generator().manual_seed(seed)
    t = _timestep(g, 1.0)
    kwargs = dict(hidden_states=_randn(g, 1, height * width, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]), timestep=t,
                  img_ids=_flux3_image_ids(height, width),
                  txt_ids=torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                               torch.arange(text)).to(torch.float32))
    if images:
        kwargs["image_cond_hidden_states"] = _randn(g, 1, images * height * width, config["cond_in_channels"])
        kwargs["image_cond_ids"] = torch.cat([_flux3_image_ids(height, width, -(1 + i)) for i in range(images)])
    if config.get("flow_map"):
        kwargs["target_timestep"] = t * torch.rand(1, generator=g)
    return (), kwargs


def glm_image_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """GlmImagePipeline (text-to-image step): latent image (1, C, h, w), the ByT5 glyph rows of the prompt's quoted
    text (only the valid tokens, packed: no mask), the AR model's int64 prior image tokens (1, h/p * w/p) (its
    (h/2p, w/2p) grid upsampled 2x nearest), ``prior_token_drop`` all False (bool, same shape; all True in the CFG
    pass), timestep t - 1 with t the flow-match t in [0, 1000), float (1, 2) target_size = the pixel size (h*8, w*8)
    and zero crop coords, and ``kv_caches`` = a ``GlmImageKVCache`` object (a Python object, not a tensor; mode None
    in text-to-image, "read" when condition images were written into it)."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    g = torch.Generator().manual_seed(seed)
    p = config["patch_size"]
    th, tw = height // (2 * p), width // (2 * p)
    d32 = torch.randint(0, config["prior_vq_quantizer_codebook_size"], (1, 1, th, tw), generator=g)
    prior = torch.nn.functional.interpolate(d32.float(), scale_factor=2, mode="nearest").long().view(1, -1)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]), prior_token_id=prior,
                    prior_token_drop=torch.zeros_like(prior, dtype=torch.bool), timestep=_timestep(g) - 1,
                    target_size=torch.tensor([[height * 8.0, width * 8.0]]), crop_coords=torch.zeros(1, 2),
                    kv_caches=GlmImageKVCache(num_layers=config["num_layers"]))


def helios_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                  width: int = 8, history: tuple = (16, 2, 1)):
    """HeliosPipeline (chunked autoregressive video, keep_first_frame=True): the chunk's latents (1, C, F, h, w),
    t in [0, 1000), UMT5 rows with padding zeroed (Wan's encoding), the history latents split by ``history`` =
    (long, mid, 1x) frame counts (pipeline default [16, 2, 1]): ``latents_history_long`` / ``_mid`` and
    ``latents_history_short`` = the prefix frame (image latent, zeros for text-to-video's first chunk) + the 1x
    frames, and int64 frame indices (1, n) for each part from one arange over prefix, long, mid, 1x, chunk."""
    g = torch.Generator().manual_seed(seed)
    long, mid, short = history
    c = config["in_channels"]
    idx = torch.arange(0, 1 + long + mid + short + frames)
    prefix, i_long, i_mid, i_1x, i_hidden = idx.split([1, long, mid, short, frames])
    return (), dict(hidden_states=_randn(g, 1, c, frames, height, width), timestep=_timestep(g),
                    encoder_hidden_states=_wan_prompt(g, text, pad, config["text_dim"]),
                    indices_hidden_states=i_hidden[None],
                    indices_latents_history_short=torch.cat([prefix, i_1x])[None],
                    indices_latents_history_mid=i_mid[None], indices_latents_history_long=i_long[None],
                    latents_history_short=_randn(g, 1, c, 1 + short, height, width),
                    latents_history_mid=_randn(g, 1, c, mid, height, width),
                    latents_history_long=_randn(g, 1, c, long, height, width))


def _hunyuandit_crop_region(src, tgt_size):
    # diffusers.pipelines.hunyuandit.pipeline_hunyuandit.get_resize_crop_region_for_grid
    th = tw = tgt_size
    h, w = src
    if h / w > 1:
        resize_height, resize_width = th, int(round(th / h * w))
    else:
        resize_width, resize_height = tw, int(round(tw / w * h))
    top, left = int(round((th - resize_height) / 2.0)), int(round((tw - resize_width) / 2.0))
    return (top, left), (top + resize_height, left + resize_width)


def hunyuandit_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, text_t5: int = 6,
                      pad_t5: int = 2, height: int = 8, width: int = 8):
    """HunyuanDiTPipeline: latent image (1, C, h, w), the timestep as a float (1,) tensor (DDPM t in [0, 1000)),
    CLIP rows (1, text, cross_attention_dim) and mT5 rows (1, text_t5, cross_attention_dim_t5), each padded to
    max_length with its int64 tokenizer mask (the model swaps padded rows for a learned padding embedding of exactly
    text_len + text_len_t5 rows, so ``text``/``text_t5`` must equal the config's ``text_len``/``text_len_t5``; 77 and
    256 in the real model), image_meta_size (1, 6) float = original size + target size (pixels) + crop (0, 0), style
    int64 [0], and the 2-D rotary (cos, sin) the pipeline computes (get_2d_rotary_pos_embed, base size 512 px)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    if (text, text_t5) != (config["text_len"], config["text_len_t5"]):
        raise InputError(f"hunyuandit: text={text}, text_t5={text_t5}, but the model takes exactly "
                         f"text_len={config['text_len']} and text_len_t5={config['text_len_t5']} rows (its learned "
                         "padding embedding has that many); build the config with the lengths you want")
    g = torch.Generator().manual_seed(seed)
    p = config["patch_size"]
    grid = (height // p, width // p)
    head_dim = config["attention_head_dim"]
    rotary = get_2d_rotary_pos_embed(head_dim, _hunyuandit_crop_region(grid, 512 // 8 // p), grid, output_type="pt")
    size = [height * 8.0, width * 8.0]
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    timestep=torch.randint(0, 1000, (1,), generator=g).float(),
                    encoder_hidden_states=_randn(g, 1, text, config["cross_attention_dim"]),
                    text_embedding_mask=_text_mask(text, pad, torch.int64),
                    encoder_hidden_states_t5=_randn(g, 1, text_t5, config["cross_attention_dim_t5"]),
                    text_embedding_mask_t5=_text_mask(text_t5, pad_t5, torch.int64),
                    image_meta_size=torch.tensor([size + size + [0.0, 0.0]]), style=torch.tensor([0]),
                    image_rotary_emb=rotary)


def hunyuan_image_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, text_2: int = 6,
                         pad_2: int = 2, height: int = 4, width: int = 4, glyph: bool = True):
    """HunyuanImagePipeline (2.1): latent image (1, C, h, w) (32x VAE), t in [0, 1000) as a float, Qwen2.5-VL rows
    padded to max_length (1000 after the template's dropped prefix) with their int64 mask, ByT5 rows of the quoted
    glyph text padded to 128 with their int64 mask (all zeros, rows and mask, when the prompt has no quoted text:
    ``glyph=False``), guidance = scale * 1000 only for a guidance-distilled config, timestep_r = the next t only for a
    meanflow config. The model reorders the text rows by the masks (valid ByT5, valid Qwen, then padding) with
    boolean indexing."""
    g = torch.Generator().manual_seed(seed)
    t = _timestep(g)
    kwargs = dict(hidden_states=_randn(g, 1, config["in_channels"], height, width), timestep=t,
                  encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.int64))
    if config.get("text_embed_2_dim"):
        if glyph:
            kwargs["encoder_hidden_states_2"] = _randn(g, 1, text_2, config["text_embed_2_dim"])
            kwargs["encoder_attention_mask_2"] = _text_mask(text_2, pad_2, torch.int64)
        else:
            kwargs["encoder_hidden_states_2"] = torch.zeros(1, text_2, config["text_embed_2_dim"])
            kwargs["encoder_attention_mask_2"] = torch.zeros(1, text_2, dtype=torch.int64)
    if config.get("guidance_embeds"):
        kwargs["guidance"] = torch.tensor([3.25 * 1000.0])
    if config.get("use_meanflow"):
        kwargs["timestep_r"] = t * torch.rand(1, generator=g)
    return (), kwargs


# --- registry --------------------------------------------------------------------------------------------------------


BUILDERS = {  # diffusers class name -> its input builder
    "AceStepTransformer1DModel": ace_step_inputs,
    "AnyFlowTransformer3DModel": anyflow_inputs,
    "AnyFlowFARTransformer3DModel": anyflow_far_inputs,
    "BriaFiboTransformer2DModel": bria_fibo_inputs,
    "BriaFibo2Transformer2DModel": bria_fibo2_inputs,
    "CogView3PlusTransformer2DModel": cogview3plus_inputs,
    "ConsisIDTransformer3DModel": consisid_inputs,
    "Cosmos3OmniTransformer": cosmos3_omni_inputs,
    "CosmosTransformer3DModel": cosmos_inputs,
    "DiTTransformer2DModel": dit_inputs,
    "DreamLiteTransformer2DModel": dreamlite_inputs,
    "ErnieImageTransformer2DModel": ernie_image_inputs,
    "Flux3Transformer2DModel": flux3_inputs,
    "GlmImageTransformer2DModel": glm_image_inputs,
    "HeliosTransformer3DModel": helios_inputs,
    "HunyuanDiT2DModel": hunyuandit_inputs,
    "HunyuanImageTransformer2DModel": hunyuan_image_inputs,
}
