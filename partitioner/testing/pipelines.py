"""Tiny real diffusers pipelines, built in-process from random weights: no hub, no files.

Every component is the real class (the pipeline's own text encoders, VAE and scheduler) at the smallest config it
accepts, seeded, and every tokenizer is the real tokenizer class built from a small vocabulary held here (CLIP's
and Qwen2's byte-pair tokenizers without merges, T5's unigram over letters and a few words). Each pipeline builds in
well under a second or two, and every builder with the same seed gives the same weights on every rank.

- ``tiny_flux_pipeline()``: ``FluxPipeline`` (CLIP + T5, guidance-distilled: one transformer call per step);
- ``tiny_sd3_pipeline()``: ``StableDiffusion3Pipeline`` (two CLIPs + T5; guidance > 1 is a batch of 2 per call);
- ``tiny_wan_pipeline(experts=2)``: ``WanPipeline`` (UMT5; guidance as two calls per step, cond then uncond; with
  two experts, ``transformer`` for the high-noise steps and ``transformer_2`` for the rest);
- ``tiny_qwen_image_pipeline()``: ``QwenImagePipeline`` (Qwen2.5-VL text encoder; true CFG as two calls per step);
- ``tiny_sd_pipeline()``: ``StableDiffusionPipeline`` (a UNet denoiser, CLIP; guidance is a batch of 2 per call);
- ``tiny_h3_modular_pipeline()``: MiniMax-H3's modular pipeline with its core denoising blocks (layout, noise, row
  timestep plan, denoising loop over ``transformer``), given prompt embeddings: H3's text encoder and VAEs are not
  built here.

``CALLS[name]`` holds a small request for each (``prompt``, size, 3 steps, ``output_type="pt"``) and ``OTHER_SIZE``
another resolution or length for a second request; ``run(pipe, name, **overrides)`` calls the pipeline and returns
every denoising step's latents (through ``callback_on_step_end``) and the decoded output.
"""

from __future__ import annotations

import string

import torch

LETTERS = string.ascii_lowercase
WORDS = ("a", "photo", "of", "cat", "dog", "red", "blue", "car", "in", "the", "snow", "dancing", "monkey", "bad",
         "quality", "blurry", "on", "beach")


# --- tokenizers: the real classes from a small vocabulary ---------------------------------------------------------

def clip_tokenizer(max_length: int = 16):
    """CLIP's BPE tokenizer over single letters (no merges): a word is one token per letter, the last with
    ``</w>``. ``model_max_length`` is what CLIP pipelines pad to."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for symbol in LETTERS + string.digits + ".,!?'-:":
            vocab[symbol + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int = 64):
    """T5's unigram tokenizer (also UMT5's) over letters, digits and a few whole words."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(symbol, -3.0) for symbol in LETTERS + string.digits + ".,!?'-:"]
    vocab += [("\u2581" + word, -1.0) for word in WORDS]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


def qwen2_tokenizer():
    """Qwen2's byte-level BPE tokenizer over the 256 byte symbols (no merges) and the chat-template tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(sorted(bytes_to_unicode().values()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def _vocab_size(tokenizer) -> int:
    return len(tokenizer)


# --- text encoders ------------------------------------------------------------------------------------------------

def _clip_text_encoder(tokenizer, *, projection: bool, hidden: int = 32, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=_vocab_size(tokenizer), hidden_size=hidden, intermediate_size=37,
                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=hidden, hidden_act="gelu")
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5_encoder(tokenizer, *, umt5: bool = False, d_model: int = 32, seed: int = 0):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = (UMT5Config if umt5 else T5Config)(vocab_size=_vocab_size(tokenizer), d_model=d_model, d_kv=8, d_ff=37,
                                                  num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return (UMT5EncoderModel if umt5 else T5EncoderModel)(config).eval()


def _qwen_text_encoder(tokenizer, *, hidden: int = 16, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=_vocab_size(tokenizer),
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1000000.0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden),
        hidden_size=hidden, vocab_size=_vocab_size(tokenizer))
    return Qwen2_5_VLForConditionalGeneration(config).eval()


# --- pipelines ----------------------------------------------------------------------------------------------------

def tiny_flux_pipeline(seed: int = 0, *, heads: int = 4):
    """``FluxPipeline``: a 2 + 2 block Flux (``heads`` x 16), CLIP (pooled) + T5 text encoders, a one-level
    ``AutoencoderKL`` (latents 4 channels at the image's size, packed 2x2), flow-matching Euler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    return _quiet(FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(),
                        text_encoder=_clip_text_encoder(tokenizer, projection=False, seed=seed + 2),
                        tokenizer=tokenizer,
                        text_encoder_2=_t5_encoder(tokenizer_2, seed=seed + 3), tokenizer_2=tokenizer_2,
                        transformer=transformer.eval()))


def tiny_sd3_pipeline(seed: int = 0, *, heads: int = 4):
    """``StableDiffusion3Pipeline``: a 2-block SD3 (``heads`` x 16, RMS qk-norm), two CLIPs with projection and T5
    (joint text rows: the CLIPs' 16 then T5's ``max_sequence_length``), a one-level ``AutoencoderKL``."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                        num_attention_heads=heads, joint_attention_dim=32, caption_projection_dim=64,
                                        pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16,
                                        qk_norm="rms_norm")
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    return _quiet(StableDiffusion3Pipeline(
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(),
        text_encoder=_clip_text_encoder(tokenizer, projection=True, seed=seed + 2), tokenizer=tokenizer,
        text_encoder_2=_clip_text_encoder(tokenizer_2, projection=True, seed=seed + 3), tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_encoder(tokenizer_3, seed=seed + 4), tokenizer_3=tokenizer_3))


def _wan_transformer(seed: int, heads: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=16,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def tiny_wan_pipeline(seed: int = 0, *, experts: int = 1, heads: int = 4):
    """``WanPipeline``: a 2-block Wan (``heads`` x 16; ``experts=2`` adds ``transformer_2`` for the low-noise steps,
    as Wan 2.2), UMT5, ``AutoencoderKLWan`` (4 latent channels, 8x spatial, 4x temporal compression)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer = t5_tokenizer()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return _quiet(WanPipeline(tokenizer=tokenizer, text_encoder=_t5_encoder(tokenizer, umt5=True, seed=seed + 2),
                       vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                       transformer=_wan_transformer(seed, heads),
                       transformer_2=_wan_transformer(seed + 5, heads) if experts == 2 else None,
                       boundary_ratio=0.5 if experts == 2 else None))


def tiny_qwen_image_pipeline(seed: int = 0, *, heads: int = 4):
    """``QwenImagePipeline``: a 2-block QwenImage (``heads`` x 16), a Qwen2.5-VL text encoder (its chat template
    tokenized byte by byte), ``AutoencoderKLQwenImage`` (4 latent channels, 4x spatial compression)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    tokenizer = qwen2_tokenizer()
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = _quiet(QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(),
                                    text_encoder=_qwen_text_encoder(tokenizer, seed=seed + 2), tokenizer=tokenizer,
                                    transformer=transformer.eval()))
    # the pipeline strips the chat template's system prefix by its token count in the real tokenizer (34); spelt
    # byte by byte here it is longer, and the rest of it would make most rows of every prompt's embedding alike
    prefix = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    return pipe


def _h3_blocks():
    """H3's t2va core denoising blocks (layout, noise, row timestep plan, the loop over ``transformer`` and the
    schedulers, unpacking) with a step that records each step's latents, then H3's decode blocks (video and audio
    VAEs)."""
    from diffusers.modular_pipelines import ModularPipelineBlocks, SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.denoise import (MiniMaxH3DenoiseStep, MiniMaxH3LoopDenoiser,
                                                                MiniMaxH3LoopSchedulerStep)
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (MiniMaxH3CoreDenoiseStep,
                                                                                  MiniMaxH3DecodeStep)

    class RecordLatents(ModularPipelineBlocks):
        """Appends the packed video and audio rows after each step to the pipeline's ``recorded_steps`` list."""
        model_name = "minimax-h3"

        @property
        def description(self) -> str:
            return "records the latents after each denoising step"

        def __call__(self, components, block_state, i, t):
            recorded = getattr(components, "recorded_steps", None)
            if recorded is not None:
                recorded.append(torch.cat([block_state.latents.flatten(), block_state.audio_latents.flatten()]))
            return components, block_state

    class RecordingDenoiseStep(MiniMaxH3DenoiseStep):
        block_classes = [MiniMaxH3LoopDenoiser, MiniMaxH3LoopSchedulerStep, RecordLatents]
        block_names = ["denoiser", "update", "record"]

    core = MiniMaxH3CoreDenoiseStep()
    loop = RecordingDenoiseStep()
    loop.set_progress_bar_config(disable=True)  # (the pipeline's own setting reaches its top-level blocks only)
    core.sub_blocks["denoise"] = loop
    return SequentialPipelineBlocks.from_blocks_dict({"denoise": core, "decode": MiniMaxH3DecodeStep()})


def tiny_h3_modular_pipeline(seed: int = 0):
    """MiniMax-H3's ``ModularPipeline`` over its t2va core denoising blocks and its decode blocks: the tiny H3
    transformer (``partitioner.testing.tiny_h3``), H3's video VAE (4 latent channels, 4x spatial and temporal
    compression, 17-frame clips) and audio VAE (8 latent channels), H3's two schedulers. Text conditioning is given
    as ``prompt_embeds`` (H3's Qwen3-VL text encoder is not built here)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from diffusers.schedulers import MiniMaxH3Scheduler

    from .models import tiny_h3

    pipe = _h3_blocks().init_pipeline()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLMiniMaxH3(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1,
                                 spatial_downsample_factors=(2, 2, 1), temporal_downsample_factors=(1, 2, 2),
                                 norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
                                 decoder_attention_head_dim=8, decoder_num_register_tokens=1, decoder_ffn_mult=1,
                                 latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    torch.manual_seed(seed + 2)
    audio_vae = AutoencoderKLMiniMaxH3Audio(encoder_dim=4, encoder_rates=(2, 2), latent_dim=8, latent_channels=8,
                                            num_attention_heads=1, decoder_dim=8, decoder_rates=(2, 2),
                                            decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                                            resblock_dilation_sizes=((1,),), latents_mean=[0.0] * 8,
                                            latents_std=[1.0] * 8)
    pipe.update_components(transformer=tiny_h3(seed), vae=vae.eval(), audio_vae=audio_vae.eval(),
                           scheduler=MiniMaxH3Scheduler(), audio_scheduler=MiniMaxH3Scheduler())
    return _quiet(pipe)


def tiny_sd_pipeline(seed: int = 0):
    """``StableDiffusionPipeline`` (SD 1.5's structure): a 2-level ``UNet2DConditionModel`` (a cross-attention
    down block and up block, 8-channel heads, group norms), CLIP, a 2-level ``AutoencoderKL`` (latents at half the
    image's size), DDIM; guidance as one call with a batch of 2."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    tokenizer = clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=4, norm_num_groups=4)
    return _quiet(StableDiffusionPipeline(
        vae=vae.eval(), text_encoder=_clip_text_encoder(tokenizer, projection=False, seed=seed + 2),
        tokenizer=tokenizer, unet=unet.eval(), scheduler=DDIMScheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False))


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


BUILDERS = {"flux": tiny_flux_pipeline, "sd3": tiny_sd3_pipeline, "wan": tiny_wan_pipeline,
            "qwen_image": tiny_qwen_image_pipeline, "h3": tiny_h3_modular_pipeline, "sd": tiny_sd_pipeline}

# A small request per pipeline: 3 steps, tensors out. Text lengths and image rows are even, so that Ulysses=2 can
# split every sequence.
CALLS = {
    "flux": dict(prompt="a photo of a cat", height=12, width=16, max_sequence_length=12, guidance_scale=3.5),
    "sd3": dict(prompt="a photo of a cat", negative_prompt="blurry", height=16, width=24, max_sequence_length=12,
                guidance_scale=5.0),
    "wan": dict(prompt="dancing monkey", negative_prompt="bad quality", height=32, width=32, num_frames=5,
                max_sequence_length=12, guidance_scale=5.0),
    "qwen_image": dict(prompt="a red car in the snow", negative_prompt="blurry", true_cfg_scale=4.0, height=32,
                       width=48, max_sequence_length=12),
    "sd": dict(prompt="a photo of a cat", negative_prompt="blurry", height=32, width=24, guidance_scale=7.5),
    # 124 frames, 5.2 s of video (H3 makes 5 to 15 s), 8x8 pixels: 37 video rows, 414 audio rows, 6 text rows
    "h3": dict(height=8, width=8, num_frames=124),
}
# A second request at another resolution (or video length)
OTHER_SIZE = {"flux": dict(height=16, width=20), "sd3": dict(height=32, width=24),
              "wan": dict(height=32, width=48, num_frames=9), "qwen_image": dict(height=48, width=48),
              "h3": dict(height=16, width=8), "sd": dict(height=24, width=32)}


def run(pipe, name: str, seed: int = 0, **overrides) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``pipe(**CALLS[name], **overrides)`` with 3 steps, a seeded generator and ``output_type="pt"``: every step's
    latents (as ``callback_on_step_end`` sees them; H3's recording loop step for its modular pipeline) and the
    decoded output (H3: video and audio, flattened into one tensor)."""
    kwargs = dict(CALLS[name], num_inference_steps=3, output_type="pt", generator=torch.Generator().manual_seed(seed))
    kwargs.update(overrides)
    if name == "h3":
        from .models import TINY_H3

        g = torch.Generator().manual_seed(seed + 100)
        text = 6
        object.__setattr__(pipe, "recorded_steps", [])
        out = pipe(prompt_embeds=torch.randn(1, text, TINY_H3["text_dim"], generator=g),
                   text_token_tags=torch.zeros(text, dtype=torch.long), output=["videos", "audio"], **kwargs)
        steps = pipe.recorded_steps
        object.__setattr__(pipe, "recorded_steps", None)
        return steps, torch.cat([out["videos"].flatten(), out["audio"].flatten()])
    steps = []

    def record(pipeline, step, timestep, tensors):
        steps.append(tensors["latents"].detach().clone())
        return {}

    output = pipe(**kwargs, callback_on_step_end=record, callback_on_step_end_tensor_inputs=["latents"])
    return steps, output.frames if hasattr(output, "frames") else output.images


__all__ = ["BUILDERS", "CALLS", "OTHER_SIZE", "clip_tokenizer", "qwen2_tokenizer", "run", "t5_tokenizer",
           "tiny_flux_pipeline", "tiny_h3_modular_pipeline", "tiny_qwen_image_pipeline", "tiny_sd3_pipeline",
           "tiny_sd_pipeline", "tiny_wan_pipeline"]
