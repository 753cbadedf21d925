"""Example inputs of diffusers transformers, built the way each model's pipeline builds them, at the sizes its
pipeline passes (``pipeline_sizes.PIPELINE_SIZES``) or at sizes the caller gives: what ``python -m partitioner``
plans a model with, and what the zoo's tests (``partitioner.testing.zoo``) run.

Each builder ``(config, seed=0, **sizes)`` accepts only the sizes its signature names: ``text`` text rows;
``pad`` how many of them are padding (trailing, as the pipelines' right-padding tokenizers leave them);
``height``/``width``/``frames`` in latent units, before patching.
"""

from __future__ import annotations

import torch

from ..errors import InputError

# --- shared pieces -------------------------------------------------------------------------------------------------

def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _timestep(g: torch.Generator, scale: float = 1000.0) -> torch.Tensor:
    """One float timestep in [0, scale): flow-matching pipelines pass ``t`` (0..1000) or ``t / 1000``."""
    return torch.rand(1, generator=g) * scale


def _text_mask(text: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """A tokenizer's (1, text) attention mask with the last ``pad`` rows padding, in the dtype the pipeline keeps."""
    if not 0 <= pad < text:
        raise InputError(f"pad={pad} must leave at least one of text={text} rows")
    mask = torch.ones(1, text, dtype=dtype)
    mask[:, text - pad:] = 0
    return mask


def _flux_ids(height: int, width: int) -> torch.Tensor:
    """FluxPipeline._prepare_latent_image_ids: (h*w, 3) float rows (0, row, col)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] += torch.arange(height)[:, None]
    ids[..., 2] += torch.arange(width)[None, :]
    return ids.reshape(height * width, 3)


def h3_inputs(config: dict, *, text: int = 5, video: int = 12, audio: int = 6, timesteps: int = 2, seed: int = 1,
              device="cpu"):
    """Inputs of one packed sequence in the layout H3's pipeline builds: text, video and audio rows scattered."""
    g = torch.Generator().manual_seed(seed)
    seq = text + video + audio
    order = torch.randperm(seq, generator=g)
    patch = config["in_channels"] * config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    kwargs = dict(
        hidden_states=torch.randn(1, video, patch, generator=g),
        audio_hidden_states=torch.randn(1, audio, config["audio_in_channels"], generator=g),
        encoder_hidden_states=torch.randn(1, text, config["text_dim"], generator=g),
        timestep=torch.rand(timesteps, generator=g),
        timestep_indices=torch.randint(0, timesteps, (seq,), generator=g),
        token_tags=torch.randint(0, 3, (seq,), generator=g),
        position_ids=torch.randint(0, 8, (seq, 3), generator=g),
        video_indices=order[:video],
        audio_indices=order[video:video + audio],
        text_indices=order[video + audio:],
    )
    return {k: v.to(device) for k, v in kwargs.items()}


def _crop_region(src, tgt_width, tgt_height):
    # diffusers.pipelines.cogvideo.pipeline_cogvideox.get_resize_crop_region_for_grid, without the pipeline import.
    h, w = src
    if h / w > tgt_height / tgt_width:
        resize_height, resize_width = tgt_height, int(round(tgt_height / h * w))
    else:
        resize_width, resize_height = tgt_width, int(round(tgt_width / w * h))
    top, left = int(round((tgt_height - resize_height) / 2.0)), int(round((tgt_width - resize_width) / 2.0))
    return (top, left), (top + resize_height, left + resize_width)


def cogvideox_rotary(config, frames: int, height: int, width: int):
    """(cos, sin), each (frames * height/p * width/p, head_dim), as CogVideoXPipeline builds it (latent sizes)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    p, p_t = config["patch_size"], config.get("patch_size_t")
    grid = (height // p, width // p)
    base_w, base_h = config["sample_width"] // p, config["sample_height"] // p
    dim = config["attention_head_dim"]
    if p_t is None:  # CogVideoX 1.0
        return get_3d_rotary_pos_embed(embed_dim=dim, crops_coords=_crop_region(grid, base_w, base_h), grid_size=grid,
                                       temporal_size=frames)
    return get_3d_rotary_pos_embed(embed_dim=dim, crops_coords=None, grid_size=grid,  # CogVideoX 1.5
                                   temporal_size=(frames + p_t - 1) // p_t, grid_type="slice",
                                   max_size=(base_h, base_w))


# --- one input builder per model class ------------------------------------------------------------------------------------

def flux_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """FluxPipeline: latents packed 2x2 into (1, h/2*w/2, in_channels), zero txt_ids, t/1000, guidance 3.5."""
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2
    kwargs = dict(hidden_states=_randn(g, 1, h * w, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                  pooled_projections=_randn(g, 1, config["pooled_projection_dim"]),
                  timestep=_timestep(g, 1.0), img_ids=_flux_ids(h, w), txt_ids=torch.zeros(text, 3))
    if config.get("guidance_embeds"):
        kwargs["guidance"] = torch.full([1], 3.5)
    return (), kwargs


def flux2_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """Flux2Pipeline: packed latents, int64 (t, h, w, l) position ids with a batch dim, t/1000, guidance 4.0."""
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
    kwargs = dict(hidden_states=_randn(g, 1, h * w, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                  timestep=_timestep(g, 1.0), img_ids=img_ids[None], txt_ids=txt_ids[None])
    if config.get("guidance_embeds", True):
        kwargs["guidance"] = torch.full([1], 4.0)
    return (), kwargs


def sd3_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """StableDiffusion3Pipeline: latent image (1, C, h, w), CLIP+T5 rows, pooled CLIP, t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                    pooled_projections=_randn(g, 1, config["pooled_projection_dim"]), timestep=_timestep(g))


def auraflow_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """AuraFlowPipeline: latent image, T5 rows (no mask), t/1000."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                    timestep=_timestep(g, 1.0))


def pixart_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """PixArtSigmaPipeline: latent image, T5 rows with their int64 mask, an int64 timestep, and
    added_cond_kwargs={"resolution": None, "aspect_ratio": None} (Sigma uses no micro-conditions)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                    encoder_attention_mask=_text_mask(text, pad, torch.int64),
                    timestep=torch.randint(0, 1000, (1,), generator=g),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def sana_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 6, width: int = 6):
    """SanaPipeline: latent image (patch 1), Gemma rows with their int64 mask, t * timestep_scale. (6 x 6 latent
    rows: a length no other dim of the tiny model has, and image rows that split over 2 ranks.)"""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                  encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.int64),
                  timestep=_timestep(g) * config.get("timestep_scale", 1.0))
    if config.get("guidance_embeds"):
        kwargs["guidance"] = torch.full([1], 4.5)
    return (), kwargs


def lumina2_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """Lumina2Pipeline: latent image, Gemma rows with their int64 mask, timestep 1 - t/1000 in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    timestep=_timestep(g, 1.0),
                    encoder_hidden_states=_randn(g, 1, text, config["cap_feat_dim"]),
                    encoder_attention_mask=_text_mask(text, pad, torch.int64))


def hidream_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """HiDreamImagePipeline: latent image, T5 rows, every Llama-3 hidden layer stacked (layers, 1, text, dim) for the
    model to pick with ``llama_layers``, pooled CLIP-L+G, t in [0, 1000). A square latent needs no padding mask; a
    non-square one is padded by the model to max_resolution's (h/p)*(w/p) patches, 16 in the tiny config."""
    g = torch.Generator().manual_seed(seed)
    t5_dim, llama_dim = config["caption_channels"]
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width), timesteps=_timestep(g),
                    encoder_hidden_states_t5=_randn(g, 1, text, t5_dim),
                    encoder_hidden_states_llama3=_randn(g, max(config["llama_layers"]) + 1, 1, text, llama_dim),
                    pooled_embeds=_randn(g, 1, config["text_emb_dim"]))


def hunyuan_video_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2,
                         height: int = 4, width: int = 8):
    """HunyuanVideoPipeline: latent video (1, C, f, h, w), Llama rows with a float mask, pooled CLIP, t in
    [0, 1000), guidance 6.0 * 1000."""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=_timestep(g),
                  encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.float32),
                  pooled_projections=_randn(g, 1, config["pooled_projection_dim"]))
    if config.get("guidance_embeds", True):
        kwargs["guidance"] = torch.tensor([6.0 * 1000.0])
    return (), kwargs


def wan_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
               width: int = 8):
    """WanPipeline: latent video, T5 rows with the padding rows zeroed (Wan passes no mask), t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    prompt = _randn(g, 1, text, config["text_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=_timestep(g),
                    encoder_hidden_states=prompt)


def ltx_video_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 2,
                     width: int = 4):
    """LTXPipeline: latents packed to (1, f*h*w, C) with the latent sizes passed as ints, T5 rows with a bool mask,
    rope_interpolation_scale (8/25 fps, 32, 32) from the VAE's compression, t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, frames * height * width, config["in_channels"]),
                    encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]), timestep=_timestep(g),
                    encoder_attention_mask=_text_mask(text, pad, torch.bool), num_frames=frames, height=height,
                    width=width, rope_interpolation_scale=(8 / 25, 32, 32))


def mochi_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                 width: int = 8):
    """MochiPipeline: latent video, T5 rows with a bool mask, t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]), timestep=_timestep(g),
                    encoder_attention_mask=_text_mask(text, pad, torch.bool))


def cogvideox_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 4, height: int = 4,
                     width: int = 4):
    """CogVideoXPipeline: latent video (1, f, C, h, w), T5 rows, an int64 timestep, and the rotary (cos, sin)
    table the pipeline computes (``cogvideox_rotary``)."""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(hidden_states=_randn(g, 1, frames, config["in_channels"], height, width),
                  encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  timestep=torch.randint(0, 1000, (1,), generator=g))
    if config.get("use_rotary_positional_embeddings"):
        kwargs["image_rotary_emb"] = cogvideox_rotary(config, frames, height, width)
    return (), kwargs


def cogview4_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """CogView4Pipeline: latent image, GLM rows, t in [0, 1000), pixel-size original/target sizes and zero crop
    coords; the model builds its own rotary table."""
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([[height * 8.0, width * 8.0]])
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]), timestep=_timestep(g),
                    original_size=size, target_size=size.clone(), crop_coords=torch.zeros(1, 2))


def qwen_image_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 8,
                      width: int = 8):
    """QwenImagePipeline: packed latents, img_shapes [[(1, h/2, w/2)]], t/1000. The pipeline drops an all-ones
    prompt mask (one prompt never has one), so the mask is passed only when pad > 0 (as for a padded batch).
    diffusers 0.42.1's forward takes no txt_seq_lens (the text length comes from the mask or the rows)."""
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2
    kwargs = dict(hidden_states=_randn(g, 1, h * w, config["in_channels"]),
                  encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                  encoder_hidden_states_mask=_text_mask(text, pad, torch.int64) if pad else None,
                  timestep=_timestep(g, 1.0), img_shapes=[[(1, h, w)]])
    if config.get("guidance_embeds"):
        kwargs["guidance"] = torch.full([1], 4.0)
    return (), kwargs


def allegro_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                   width: int = 8):
    """AllegroPipeline: latent video, T5 rows with their int64 mask, t in [0, 1000), and the pipeline's rotary
    ((freqs_t, freqs_h, freqs_w), (grid_t, grid_h, grid_w)) from ``get_3d_rotary_pos_embed_allegro``."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    g = torch.Generator().manual_seed(seed)
    grid = (height // config["patch_size"], width // config["patch_size"])
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=config["attention_head_dim"], crops_coords=((0, 0), grid), grid_size=grid, temporal_size=frames,
        interpolation_scale=(config["interpolation_scale_t"], config["interpolation_scale_h"],
                             config["interpolation_scale_w"]))
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    grid_t, grid_h, grid_w = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]), timestep=_timestep(g),
                    encoder_attention_mask=_text_mask(text, pad, torch.int64),
                    image_rotary_emb=((freqs_t, freqs_h, freqs_w), (grid_t, grid_h, grid_w)))


def minimax_h3_inputs(config: dict, seed: int = 0, *, text: int = 6, video: int = 16, audio: int = 6,
                      timesteps: int = 2):
    """MiniMax-H3's packed text/video/audio rows (``partitioner.testing.models.h3_inputs``); 28 rows by default."""
    return (), h3_inputs(config, text=text, video=video, audio=audio, timesteps=timesteps, seed=seed)


# --- added for issue 34: models the zoo did not have --------------------------------------------------------------

def chroma_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """ChromaPipeline: packed latents, zero txt_ids, t/1000 (no pooled text, no guidance: Chroma's approximator
    makes the modulation from the timestep alone), and the T5 mask extended with ones over the image rows
    (``_prepare_attention_mask``), bool."""
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2
    mask = torch.cat([_text_mask(text, pad, torch.bool), torch.ones(1, h * w, dtype=torch.bool)], dim=1)
    return (), dict(hidden_states=_randn(g, 1, h * w, config["in_channels"]),
                    encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                    timestep=_timestep(g, 1.0), img_ids=_flux_ids(h, w), txt_ids=torch.zeros(text, 3),
                    attention_mask=mask)


def bria_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """BriaPipeline: packed latents, zero text ids and Flux's image ids (batch dim dropped, as the pipeline does),
    t in [0, 1000), no pooled text."""
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2
    return (), dict(hidden_states=_randn(g, 1, h * w, config["in_channels"]),
                    encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]), timestep=_timestep(g),
                    img_ids=_flux_ids(h, w), txt_ids=torch.zeros(text, 3))


def chronoedit_inputs(config: dict, seed: int = 0, *, text: int = 512, pad: int = 505, frames: int = 2,
                      height: int = 4, width: int = 8, image_rows: int = 5):
    """ChronoEditPipeline (Wan image-to-video): the latents concatenated on channels with the condition (a frame
    mask, 1 on the input image's frame, and the image's latents), T5 rows with padding zeroed, CLIP image rows,
    t in [0, 1000). The pipeline always pads the prompt to 512 rows: the model finds the image rows as the ones
    before the last 512 (``transformer_chronoedit.py:92``), so ``text`` must be 512."""
    if text != 512:
        raise InputError(f"chronoedit: text={text}, but the model takes the last 512 rows as text (the pipeline's "
                         "max_sequence_length); pass text=512 and choose pad")
    g = torch.Generator().manual_seed(seed)
    mask_channels = (config["in_channels"] - config["out_channels"]) // 2
    mask = torch.zeros(1, mask_channels, frames, height, width)
    mask[:, :, 0] = 1.0
    condition = torch.cat([mask, _randn(g, 1, config["in_channels"] - config["out_channels"] - mask_channels,
                                        frames, height, width)], dim=1)
    latents = torch.cat([_randn(g, 1, config["out_channels"], frames, height, width), condition], dim=1)
    prompt = _randn(g, 1, text, config["text_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=latents, timestep=_timestep(g), encoder_hidden_states=prompt,
                    encoder_hidden_states_image=_randn(g, 1, image_rows, config["image_dim"]))


def wan_vace_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                    width: int = 8):
    """WanVACEPipeline: latent video, the conditioning latents (the control video's inactive and reactive latents
    and its mask, ``vace_in_channels`` in all), one conditioning scale per VACE layer, T5 rows, t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    prompt = _randn(g, 1, text, config["text_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=_timestep(g),
                    encoder_hidden_states=prompt,
                    control_hidden_states=_randn(g, 1, config["vace_in_channels"], frames, height, width),
                    control_hidden_states_scale=torch.ones(len(config["vace_layers"])))


def kandinsky5_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 2, height: int = 4,
                      width: int = 8):
    """Kandinsky5T2VPipeline: channels-last latents (1, f, h, w, C), Qwen rows, pooled CLIP, t in [0, 1000), the
    rotary positions as aranges per axis (patched sizes) and of the prompt's rows."""
    g = torch.Generator().manual_seed(seed)
    _, ph, pw = config["patch_size"]
    return (), dict(hidden_states=_randn(g, 1, frames, height, width, config["in_visual_dim"]),
                    encoder_hidden_states=_randn(g, 1, text, config["in_text_dim"]),
                    timestep=_timestep(g), pooled_projections=_randn(g, 1, config["in_text_dim2"]),
                    visual_rope_pos=[torch.arange(frames), torch.arange(height // ph), torch.arange(width // pw)],
                    text_rope_pos=torch.arange(text), scale_factor=(1.0, 1.0, 1.0))


def easyanimate_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int = 2, height: int = 4,
                       width: int = 8):
    """EasyAnimatePipeline (text-to-video): latent video, Qwen2-VL rows (no mask passed), t in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=_timestep(g),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]))


def hunyuan_video15_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2,
                           height: int = 4, width: int = 8, text_2: int = 6, pad_2: int = 2, image_rows: int = 5,
                           image: bool = False):
    """HunyuanVideo15Pipeline: latents, condition latents and their mask concatenated on channels, Qwen rows and
    ByT5 rows (glyph text) with int64 masks, t in [0, 1000) as a float; text-to-video passes
    ``image_embeds`` all zeros (the model tests for it in Python), image-to-video the vision encoder's rows."""
    g = torch.Generator().manual_seed(seed)
    vision = (1, image_rows, config["image_embed_dim"])
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width), timestep=_timestep(g),
                    encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                    encoder_attention_mask=_text_mask(text, pad, torch.int64),
                    encoder_hidden_states_2=_randn(g, 1, text_2, config["text_embed_2_dim"]),
                    encoder_attention_mask_2=_text_mask(text_2, pad_2, torch.int64),
                    image_embeds=_randn(g, *vision) if image else torch.zeros(vision))
