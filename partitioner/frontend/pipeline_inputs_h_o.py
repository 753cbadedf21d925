"""Input builders for the diffusers transformers of ``testing.catalog`` outside the zoo, HunyuanVideoFramepack to
OvisImage (alphabetically), each built the way its pipeline builds what it passes to the model, in the style of
``pipeline_inputs``: ``text`` text rows, ``pad`` of them trailing padding, ``height``/``width``/``frames`` in latent
units before patching."""

from __future__ import annotations

import torch

from ..errors import InputError
from .pipeline_inputs import _flux_ids, _randn, _text_mask, _timestep



# --- HunyuanVideoFramepackTransformer3DModel -------------------------------------------------------------------------

def hunyuan_video_framepack_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2,
                                   height: int = 4, width: int = 8, image_rows: int = 5,
                                   history_sizes: tuple = (1, 2, 16)):
    """HunyuanVideoFramepackPipeline (inverted anti-drifting sampling, first section, no latent padding): the
    window's latent video, Llama rows with their float mask (transformer dtype), pooled CLIP, SigLIP image rows,
    t in [0, 1000) expanded to the batch, guidance 6.0 * 1000; the clean latents (the image latent + the 1x history,
    1 + history_sizes[0] frames) and the 2x / 4x history latents (zeros on the first section, as the pipeline's
    fresh history buffer), each with its 1-D int64 frame indices split from one arange (prefix, window, 1x, 2x, 4x)."""
    g = torch.Generator().manual_seed(seed)
    c = config["in_channels"]
    h1, h2, h4 = history_sizes
    indices = torch.arange(0, 1 + frames + h1 + h2 + h4)
    prefix, idx_latents, idx_1x, idx_2x, idx_4x = indices.split([1, frames, h1, h2, h4], dim=0)
    history = torch.zeros(1, c, h1 + h2 + h4, height, width)
    hist_1x, hist_2x, hist_4x = history.split([h1, h2, h4], dim=2)
    image_latents = _randn(g, 1, c, 1, height, width)
    kwargs = dict(hidden_states=_randn(g, 1, c, frames, height, width),
                  timestep=_timestep(g).expand(1),
                  encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.float32),
                  pooled_projections=_randn(g, 1, config["pooled_projection_dim"]),
                  image_embeds=_randn(g, 1, image_rows, config["image_proj_dim"]),
                  indices_latents=idx_latents,
                  guidance=torch.tensor([6.0]) * 1000.0,
                  latents_clean=torch.cat([image_latents, hist_1x], dim=2),
                  indices_latents_clean=torch.cat([prefix, idx_1x], dim=0),
                  latents_history_2x=hist_2x, indices_latents_history_2x=idx_2x,
                  latents_history_4x=hist_4x, indices_latents_history_4x=idx_4x)
    return (), kwargs


# --- Ideogram4Transformer2DModel --------------------------------------------------------------------------------------

def ideogram4_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """Ideogram4Pipeline, conditional pass: one packed sequence ``[left padding][text][image]`` of ``text`` +
    (h/2)*(w/2) rows. hidden_states is zeros over the text region then the packed latents; encoder_hidden_states is
    the stacked Qwen3-VL tap features (padding rows zeroed) then zeros over the image region; int64 (t, h, w)
    position ids (text: arange three times; image: (0, row, col) + 65536), int64 segment ids (-1 on the LEFT
    padding, 1 elsewhere) and int64 indicator (0 pad, 3 text, 2 image); timestep is model time 1 - t/1000 in [0, 1]
    expanded to the batch. The pipeline tokenizes into a left-padded buffer of max_sequence_length (2048) rows."""
    if not 0 <= pad < text:
        raise InputError(f"pad={pad} must leave at least one of text={text} rows")
    g = torch.Generator().manual_seed(seed)
    gh, gw = height // 2, width // 2
    n_img, n_txt = gh * gw, text - pad
    h_idx = torch.arange(gh).view(-1, 1).expand(gh, gw).reshape(-1)
    w_idx = torch.arange(gw).view(1, -1).expand(gh, gw).reshape(-1)
    image_pos = torch.stack([torch.zeros_like(h_idx), h_idx, w_idx], dim=1) + 65536
    position_ids = torch.zeros(1, text + n_img, 3, dtype=torch.long)
    position_ids[0, pad:text] = torch.arange(n_txt)[:, None].expand(n_txt, 3)
    position_ids[0, text:] = image_pos
    segment_ids = torch.full((1, text + n_img), -1, dtype=torch.long)
    segment_ids[0, pad:] = 1
    indicator = torch.zeros(1, text + n_img, dtype=torch.long)
    indicator[0, pad:text] = 3
    indicator[0, text:] = 2
    features = _randn(g, 1, text, config["llm_features_dim"])
    features[:, :pad] = 0.0
    latents = _randn(g, 1, n_img, config["in_channels"])
    return (), dict(hidden_states=torch.cat([torch.zeros(1, text, config["in_channels"]), latents], dim=1),
                    timestep=(1.0 - _timestep(g) / 1000.0).expand(1),
                    encoder_hidden_states=torch.cat([features, torch.zeros(1, n_img, config["llm_features_dim"])], 1),
                    position_ids=position_ids, segment_ids=segment_ids, indicator=indicator)


# --- JoyImageEditTransformer3DModel / JoyImageEditPlusTransformer3DModel ----------------------------------------------

def joyimage_edit_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 4, width: int = 8,
                         image: bool = True):
    """JoyImageEditPipeline: 6-D latents (1, items, C, 1, h, w): with a reference image (editing) items = 2, the
    image's VAE latents then the noise (the model moves the last item first); without one items = 1. Qwen3-VL rows
    of one prompt (no mask is passed: a single prompt has no padding), t in [0, 1000) repeated to the batch."""
    g = torch.Generator().manual_seed(seed)
    items = 2 if image else 1
    return (), dict(hidden_states=_randn(g, 1, items, config["in_channels"], 1, height, width),
                    timestep=_timestep(g).repeat(1),
                    encoder_hidden_states=_randn(g, 1, text, config["text_dim"]))


def joyimage_edit_plus_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 4,
                              width: int = 8, refs: int = 1, ref_height: int = 4, ref_width: int = 4):
    """JoyImageEditPlusPipeline: latents patchified per item into (1, patches, C, pt, ph, pw): the target's noise
    patches first, then each reference image's latent patches; ``shape_list`` a Python list (per sample) of
    (t, h, w) int tuples in patch units, from which the model builds its rotary table and image mask in Python;
    Qwen3-VL rows with their int64 attention mask (passed even when all ones; ``pad`` trailing zeros as the CFG
    batch's right padding ``_pad_sequence`` leaves), t in [0, 1000) repeated to the batch."""
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    c = config["in_channels"]
    items = [(1, height, width)] + [(1, ref_height, ref_width)] * refs
    patches, shapes = [], []
    for t, h, w in items:
        lt, lh, lw = t // pt, h // ph, w // pw
        x = _randn(g, c, t, h, w).reshape(c, lt, pt, lh, ph, lw, pw)
        patches.append(x.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, c, pt, ph, pw))
        shapes.append((lt, lh, lw))
    return (), dict(hidden_states=torch.cat(patches, dim=0)[None], timestep=_timestep(g).repeat(1),
                    encoder_hidden_states=_randn(g, 1, text, config["text_dim"]),
                    encoder_hidden_states_mask=_text_mask(text, pad, torch.int64), shape_list=[shapes])


# --- Kandinsky6Transformer3DModel / Kandinsky6SRTransformer3DModel ----------------------------------------------------

def kandinsky6_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                      width: int = 8, audio: int | None = None, image: bool = False):
    """Kandinsky6TI2VAPipeline: channels-last latents (1, f, h, w, C) concatenated on channels with the (always
    zero) conditioning latent and a one-channel conditioning mask (2C+1 channels); audio latents (1, audio,
    in_audio_dim), ``audio`` by default the pipeline's ceil(((f-1)*4+1)/24 fps*44100/1024 hop) rows; Qwen2.5-VL rows
    padded to max_length with a bool mask (the pipeline passes None when no row is padded, so pad=0 gives None);
    pooled CLIP, t in [0, 1000) expanded to the batch. With ``image`` (image-to-video) the clean first-frame latent
    is appended as an extra tail frame (mask 1 on it), ``visual_rope_pos`` a tuple of per-axis aranges whose temporal
    one ends with a 0 (the tail frame reuses position 0), and int64 per-frame ``visual_token_type_ids`` (1 on it)."""
    g = torch.Generator().manual_seed(seed)
    c = config["in_visual_dim"]
    if audio is None:
        audio = -(-((frames - 1) * 4 + 1) * 44100 // (24 * 1024))
    latents = _randn(g, 1, frames, height, width, c)
    kwargs = {}
    if image:
        latents = torch.cat([latents, _randn(g, 1, 1, height, width, c)], dim=1)
        types = torch.zeros(1, frames + 1, dtype=torch.long)
        types[:, -1] = 1
        _, ph, pw = config["patch_size"]
        kwargs.update(visual_token_type_ids=types,
                      visual_rope_pos=(torch.cat([torch.arange(frames), torch.zeros(1, dtype=torch.long)]),
                                       torch.arange(height // ph), torch.arange(width // pw)))
    cond_mask = torch.zeros(*latents.shape[:-1], 1)
    if image:
        cond_mask[:, -1] = 1
    hidden = torch.cat([latents, torch.zeros_like(latents), cond_mask], dim=-1) if config.get("visual_cond", True) \
        else latents
    kwargs.update(hidden_states=hidden, audio_hidden_states=_randn(g, 1, audio, config["in_audio_dim"]),
                  encoder_hidden_states=_randn(g, 1, text, config["in_text_dim"]),
                  pooled_projections=_randn(g, 1, config["in_text_dim2"]), timestep=_timestep(g).expand(1),
                  encoder_attention_mask=_text_mask(text, pad, torch.bool) if pad else None)
    return (), kwargs


def kandinsky6_sr_inputs(config: dict, seed: int = 0, *, frames: int = 1, height: int = 8, width: int = 8,
                         tiles: int = 1):
    """Kandinsky6SRPipeline (text-free): ``tiles`` latent tiles (tiles_batch_size, 1 by default) channels-last
    (tiles, f, h, w, C), the low-quality latents mixed with noise (sqrt(1-0.7^2)*lq + 0.7*noise), concatenated with
    the zero anchor latent and zero anchor mask (2C+1 channels); t in [0, 1000) expanded to the tiles. The token
    grid (h, w after patching) must be divisible by 8 (NABLA's 8x8 blocks)."""
    g = torch.Generator().manual_seed(seed)
    c = config["in_visual_dim"]
    lq = _randn(g, tiles, frames, height, width, c)
    latents = (1 - 0.7 ** 2) ** 0.5 * lq + 0.7 * _randn(g, tiles, frames, height, width, c)
    hidden = torch.cat([latents, torch.zeros_like(latents), torch.zeros(tiles, frames, height, width, 1)], dim=-1)
    return (), dict(hidden_states=hidden, timestep=_timestep(g).expand(tiles))


# --- Krea2Transformer2DModel ------------------------------------------------------------------------------------------

def krea2_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8,
                 suffix: int = 5):
    """Krea2Pipeline: latents packed 2x2 into (1, h/2*w/2, in_channels); the stack of tapped Qwen3-VL hidden states
    (1, text, num_text_layers, text_hidden_dim) with a bool mask padded in the MIDDLE of the template
    (``[prompt | pad | assistant suffix]``: the suffix's ``suffix`` (5) tokens are appended after the padding, so
    ``pad`` zeros sit before the last 5 rows); float (text + h/2*w/2, 3) position ids with no batch dim (text rows
    0, image rows (0, row, col)); t/1000 in [0, 1] expanded to the batch."""
    if not 0 <= pad <= text - suffix:
        raise InputError(f"pad={pad} must fit in text={text} rows beside the {suffix} suffix rows")
    g = torch.Generator().manual_seed(seed)
    gh, gw = height // 2, width // 2
    mask = torch.ones(1, text, dtype=torch.bool)
    mask[:, text - suffix - pad:text - suffix] = False
    position_ids = torch.cat([torch.zeros(text, 3), _flux_ids(gh, gw)], dim=0)
    return (), dict(hidden_states=_randn(g, 1, gh * gw, config["in_channels"]),
                    encoder_hidden_states=_randn(g, 1, text, config["num_text_layers"], config["text_hidden_dim"]),
                    timestep=_timestep(g, 1.0).expand(1), position_ids=position_ids, encoder_attention_mask=mask)


# --- LTX2VideoTransformer3DModel --------------------------------------------------------------------------------------

def ltx2_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, frames: int = 2, height: int = 2,
                width: int = 4, frame_rate: float = 24.0):
    """LTX2Pipeline (text-to-video+audio): video latents packed to (1, f*h*w, C) (patch 1), audio latents packed to
    (1, audio_frames, C*mel) with audio_frames = round(((f-1)*8+1)/fps * 16000/160/4); the text connectors' video and
    audio prompt rows (caption_channels wide) with the connectors' int64 binary mask (all ones with the released
    checkpoints' learnable registers, which replace padding; ``pad`` left-padding zeros otherwise, Gemma pads left,
    the padded video rows zeroed); t in [0, 1000) expanded to the batch and passed again as ``sigma``; the latent
    sizes, fps and audio frame count as Python numbers, and the pipeline's precomputed float32 ``video_coords``
    (1, 3, N, 2) and ``audio_coords`` (1, 1, A, 2) patch bounds (from the model's rope helpers); the keyword flags
    the pipeline passes (isolate_modalities=False, no STG blocks, use_cross_timestep=True)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    g = torch.Generator().manual_seed(seed)
    p, pt = config.get("patch_size", 1), config.get("patch_size_t", 1)
    num_frames = (frames - 1) * config.get("vae_scale_factors", (8, 32, 32))[0] + 1
    sr, hop, asf = config.get("audio_sampling_rate", 16000), config.get("audio_hop_length", 160), \
        config.get("audio_scale_factor", 4)
    audio_frames = round(num_frames / frame_rate * (sr / hop / float(asf)))
    video_rope = LTX2AudioVideoRotaryPosEmbed(dim=16, patch_size=p, patch_size_t=pt,
                                              scale_factors=config.get("vae_scale_factors", (8, 32, 32)),
                                              causal_offset=config.get("causal_offset", 1), modality="video")
    audio_rope = LTX2AudioVideoRotaryPosEmbed(dim=16, patch_size=config.get("audio_patch_size", 1),
                                              patch_size_t=config.get("audio_patch_size_t", 1), sampling_rate=sr,
                                              hop_length=hop, scale_factors=[asf],
                                              causal_offset=config.get("causal_offset", 1), modality="audio")
    mask = torch.ones(1, text, dtype=torch.int64)
    if pad:
        if not 0 <= pad < text:
            raise InputError(f"pad={pad} must leave at least one of text={text} rows")
        mask[:, :pad] = 0
    t = _timestep(g).expand(1)
    video_text = _randn(g, 1, text, config["caption_channels"]) * mask[..., None]
    return (), dict(hidden_states=_randn(g, 1, frames * height * width, config["in_channels"]),
                    audio_hidden_states=_randn(g, 1, audio_frames, config["audio_in_channels"]),
                    encoder_hidden_states=video_text,
                    audio_encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                    timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                    num_frames=frames, height=height, width=width, fps=frame_rate, audio_num_frames=audio_frames,
                    video_coords=video_rope.prepare_video_coords(1, frames, height, width, "cpu", fps=frame_rate),
                    audio_coords=audio_rope.prepare_audio_coords(1, audio_frames, "cpu"),
                    isolate_modalities=False, spatio_temporal_guidance_blocks=None, perturbation_mask=None,
                    use_cross_timestep=True)


# --- LatteTransformer3DModel ------------------------------------------------------------------------------------------

def latte_inputs(config: dict, seed: int = 0, *, text: int = 8, frames: int | None = None, height: int = 8,
                 width: int = 8):
    """LattePipeline: latent video (1, C, f, h, w) with f = the config's video_length (the model adds a temporal
    position table of that length); T5 rows cut to the prompt's valid tokens (``mask_feature``: for one prompt the
    pipeline slices the 120-row padded embedding to ``mask.sum().item()`` rows, so ``text`` = the valid count and no
    mask is passed); an int64 DDIM timestep in [0, 1000) expanded to the batch; enable_temporal_attentions=True."""
    g = torch.Generator().manual_seed(seed)
    frames = config.get("video_length", 16) if frames is None else frames
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames, height, width),
                    encoder_hidden_states=_randn(g, 1, text, config["caption_channels"]),
                    timestep=torch.randint(0, 1000, (1,), generator=g), enable_temporal_attentions=True)


# --- LongCatAudioDiTTransformer ---------------------------------------------------------------------------------------

def longcat_audio_dit_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, frames: int = 16):
    """LongCatAudioDiTPipeline: noise latents (1, frames, latent_dim) with their bool duration mask (all True for
    one prompt: ``_lens_to_mask`` of the duration), UMT5 rows with a bool length mask (the tokenizer pads to the
    longest prompt, so one prompt has no padding; ``pad`` trailing False rows as in a batch), an all-zero
    ``latent_cond`` (1, frames, latent_dim) (text-to-audio has no audio prompt), and t/1000 in [0, 1] expanded to
    the batch (the model's sinusoid multiplies by 1000)."""
    g = torch.Generator().manual_seed(seed)
    d = config["latent_dim"]
    return (), dict(hidden_states=_randn(g, 1, frames, d),
                    encoder_hidden_states=_randn(g, 1, text, config["dit_text_dim"]),
                    encoder_attention_mask=_text_mask(text, pad, torch.bool), timestep=_timestep(g, 1.0).expand(1),
                    attention_mask=torch.ones(1, frames, dtype=torch.bool), latent_cond=torch.zeros(1, frames, d))


def _diagonal_text_ids(text: int) -> torch.Tensor:
    """(text, 3) float text ids (0, i, i): LongCat-Image's and Ovis-Image's pipelines."""
    ids = torch.zeros(text, 3)
    ids[:, 1:] = torch.arange(text, dtype=torch.float32)[:, None]
    return ids


# --- LongCatImageTransformer2DModel -----------------------------------------------------------------------------------

def longcat_image_inputs(config: dict, seed: int = 0, *, text: int = 8, height: int = 8, width: int = 8):
    """LongCatImagePipeline: latents packed 2x2 into (1, h/2*w/2, in_channels); Qwen2.5-VL rows padded to the
    tokenizer's max length (512) and passed WITHOUT a mask (padding rows are attended like real ones); float
    (text, 3) text ids (0, i, i) and image ids (1, text + row, text + col) (image positions start at the tokenizer
    max length, i.e. the padded text length), no batch dim; timestep t/1000 (the model multiplies by 1000 again);
    guidance None."""
    g = torch.Generator().manual_seed(seed)
    gh, gw = height // 2, width // 2
    img_ids = _flux_ids(gh, gw)
    img_ids[:, 0] = 1
    img_ids[:, 1:] += text
    return (), dict(hidden_states=_randn(g, 1, gh * gw, config["in_channels"]), timestep=_timestep(g, 1.0).expand(1),
                    guidance=None, encoder_hidden_states=_randn(g, 1, text, config["joint_attention_dim"]),
                    txt_ids=_diagonal_text_ids(text), img_ids=img_ids)


# --- LuminaNextDiT2DModel ---------------------------------------------------------------------------------------------

def lumina_next_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 0, height: int = 8,
                       width: int = 8):
    """LuminaPipeline (Lumina-Next): latent image (1, C, h, w); Gemma rows with the tokenizer's int64 mask (padding
    to the longest prompt: none for one prompt; ``pad`` trailing zeros as in a CFG batch); timestep reversed to
    1 - t/1000 in [0, 1] (float32); the pipeline's complex64 rotary table
    ``get_2d_rotary_pos_embed_lumina(head_dim, 384, 384, linear_factor=s)`` (384 x 384 x head_dim/2, which the model
    crops to the patch grid; s = sqrt(h*w) / sample_size, the resolution scaling, linear since t < the 1.0
    watershed), and ``cross_attention_kwargs={"base_sequence_length": (sample_size*8 // 16) ** 2}`` (proportional
    attention, on by default: a Python int the attention uses in ``math.log``)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    g = torch.Generator().manual_seed(seed)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    sample = config.get("sample_size", 128)
    scaling = (height * width) ** 0.5 / sample
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], height, width),
                    timestep=1.0 - _timestep(g) / 1000.0,
                    encoder_hidden_states=_randn(g, 1, text, config["cross_attention_dim"]),
                    encoder_mask=_text_mask(text, pad, torch.int64),
                    image_rotary_emb=get_2d_rotary_pos_embed_lumina(head_dim, 384, 384, linear_factor=scaling),
                    cross_attention_kwargs={"base_sequence_length": (sample * 8 // 16) ** 2})


# --- MiniMaxMusic3Transformer1DModel / MiniMaxMusic3RVQDepthDecoder ---------------------------------------------------

def minimax_music3_inputs(config: dict, seed: int = 0, *, frames: int = 16):
    """MiniMax Music 3 modular pipeline (``MiniMaxMusic3ChunkDenoiseInner``; there is no classic pipeline): one
    window's noise latents channels-first (1, in_channels, frames) and the ``MiniMaxMusic3ConditionEncoder``'s
    frame-aligned condition (1, frames, condition_dim) (no text rows: the condition is the autoregressive stage's
    per-frame hidden states resampled onto the latent timeline; the unconditional pass gets zeros); the scheduler
    timestep passed directly, expanded to the batch (flow-matching time in [0, 1] per the pipeline's comment)."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(hidden_states=_randn(g, 1, config["in_channels"], frames), timestep=_timestep(g, 1.0).expand(1),
                    encoder_hidden_states=_randn(g, 1, frames, config["condition_dim"]))


def minimax_music3_rvq_depth_decoder_inputs(config: dict, seed: int = 0, *, steps: int = 8):
    """MiniMax Music 3 modular pipeline (``_generate_depth_codes``): the depth decoder runs once per residual
    codebook on the growing depth sequence (2 .. num_codebooks steps: the global LM's last hidden state, the semantic
    code's embedding, then each sampled code's embedding, each through ``projection``), batch 2 = the
    [conditional, unconditional] CFG pair; it takes only ``inputs_embeds`` (1, steps, hidden) -> here (2, steps,
    hidden), and attends causally. No text."""
    g = torch.Generator().manual_seed(seed)
    return (), dict(inputs_embeds=_randn(g, 2, steps, config["hidden_size"]))


# --- MotifVideoTransformer3DModel -------------------------------------------------------------------------------------

def motif_video_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, frames: int = 2, height: int = 4,
                       width: int = 8, image: bool = False, image_rows: int = 5):
    """MotifVideoPipeline: latent video concatenated on channels with the condition latent and a one-channel mask
    ``[latents | latent_condition | latent_mask]`` (2C+1 channels; text-to-video: both zeros); T5Gemma rows padded
    to max_length (512) with a bool mask; t in [0, 1000) expanded to the batch. With ``image``
    (MotifVideoImage2VideoPipeline): the first frame's latents in the condition's frame 0, mask 1 on frame 0, and
    SigLIP ``image_embeds`` rows (the model prepends them to the text, with ones in the mask)."""
    g = torch.Generator().manual_seed(seed)
    c = (config["in_channels"] - 1) // 2
    latents = _randn(g, 1, c, frames, height, width)
    condition = torch.zeros_like(latents)
    mask = torch.zeros(1, 1, frames, height, width)
    kwargs = {}
    if image:
        condition[:, :, :1] = _randn(g, 1, c, 1, height, width)
        mask[:, :, 0] = 1.0
        kwargs["image_embeds"] = _randn(g, 1, image_rows, config["image_embed_dim"])
    kwargs.update(hidden_states=torch.cat([latents, condition, mask], dim=1), timestep=_timestep(g).expand(1),
                  encoder_hidden_states=_randn(g, 1, text, config["text_embed_dim"]),
                  encoder_attention_mask=_text_mask(text, pad, torch.bool))
    return (), kwargs


# --- OmniGenTransformer2DModel ----------------------------------------------------------------------------------------

def omnigen_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8,
                   pad_token_id: int = 2):
    """OmniGenPipeline (text-to-image; it always runs CFG, so batch 2 = [conditional, unconditional]): the latent
    image repeated to the batch; int64 token ``input_ids`` (the model embeds them itself) left-padded by the
    OmniGenCollator (pad id 2) to the longest prompt: ``text`` rows, the second row with ``pad`` leading pads; an
    empty Python list ``input_img_latents`` and an empty dict ``input_image_sizes`` (no input images); the
    collator's float (2, S, S) attention mask over S = text + 1 (time token) + (h/2)*(w/2) rows (causal over the
    prompt and time token, the image rows attend to everything, padded columns 0, padded rows all 1) and its int64
    (2, S) position ids (0 on padding, then 0..); timestep t in [0, 1) (a FlowMatch scheduler with
    num_train_timesteps=1, invert_sigmas) expanded to the batch."""
    if not 0 <= pad < text:
        raise InputError(f"pad={pad} must leave at least one of text={text} rows")
    g = torch.Generator().manual_seed(seed)
    img = (height // config.get("patch_size", 2)) * (width // config.get("patch_size", 2))
    seq = text + img + 1
    ids = torch.randint(3, config["vocab_size"], (2, text), generator=g)
    ids[1, :pad] = pad_token_id
    masks, positions = [], []
    for valid in (text, text - pad):
        pad_l = text - valid
        m = torch.cat([torch.tril(torch.ones(valid + 1, valid + 1)), torch.zeros(valid + 1, img)], dim=-1)
        m = torch.cat([m, torch.ones(img, valid + img + 1)], dim=0)
        if pad_l:
            m = torch.cat([torch.zeros(valid + 1 + img, pad_l), m], dim=-1)
            m = torch.cat([torch.ones(pad_l, seq), m], dim=0)
        masks.append(m)
        positions.append([0] * pad_l + list(range(valid + img + 1)))
    latents = _randn(g, 1, config["in_channels"], height, width)
    return (), dict(hidden_states=torch.cat([latents] * 2), timestep=_timestep(g, 1.0).expand(2), input_ids=ids,
                    input_img_latents=[], input_image_sizes={}, attention_mask=torch.stack(masks),
                    position_ids=torch.LongTensor(positions))


# --- OvisImageTransformer2DModel --------------------------------------------------------------------------------------

def ovis_image_inputs(config: dict, seed: int = 0, *, text: int = 8, pad: int = 2, height: int = 8, width: int = 8):
    """OvisImagePipeline: latents packed 2x2 into (1, h/2*w/2, in_channels); Ovis (Qwen3) rows padded to
    max_length with the padded rows zeroed (``prompt_embeds * attention_mask``) and NO mask passed (trailing padding
    here; the side is the tokenizer's); float (text, 3) text ids (0, i, i) and Flux-style image ids (0, row, col), no
    batch dim; timestep t/1000 (the model multiplies by 1000 again); joint_attention_kwargs None."""
    g = torch.Generator().manual_seed(seed)
    gh, gw = height // 2, width // 2
    prompt = _randn(g, 1, text, config["joint_attention_dim"]) * _text_mask(text, pad, torch.float32)[..., None]
    return (), dict(hidden_states=_randn(g, 1, gh * gw, config["in_channels"]), timestep=_timestep(g, 1.0).expand(1),
                    encoder_hidden_states=prompt, txt_ids=_diagonal_text_ids(text), img_ids=_flux_ids(gh, gw))


BUILDERS = {  # diffusers class name -> its input builder
    "HunyuanVideoFramepackTransformer3DModel": hunyuan_video_framepack_inputs,
    "Ideogram4Transformer2DModel": ideogram4_inputs,
    "JoyImageEditPlusTransformer3DModel": joyimage_edit_plus_inputs,
    "JoyImageEditTransformer3DModel": joyimage_edit_inputs,
    "Kandinsky6SRTransformer3DModel": kandinsky6_sr_inputs,
    "Kandinsky6Transformer3DModel": kandinsky6_inputs,
    "Krea2Transformer2DModel": krea2_inputs,
    "LTX2VideoTransformer3DModel": ltx2_inputs,
    "LatteTransformer3DModel": latte_inputs,
    "LongCatAudioDiTTransformer": longcat_audio_dit_inputs,
    "LongCatImageTransformer2DModel": longcat_image_inputs,
    "LuminaNextDiT2DModel": lumina_next_inputs,
    "MiniMaxMusic3RVQDepthDecoder": minimax_music3_rvq_depth_decoder_inputs,
    "MiniMaxMusic3Transformer1DModel": minimax_music3_inputs,
    "MotifVideoTransformer3DModel": motif_video_inputs,
    "OmniGenTransformer2DModel": omnigen_inputs,
    "OvisImageTransformer2DModel": ovis_image_inputs,
}
