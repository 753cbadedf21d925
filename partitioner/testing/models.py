"""Small models and their inputs for examples, tests and benchmarks: a tiny random MiniMax-H3 and its packed
inputs, Flux, CogVideoX and CogView4 (which rotate q/k in place), H3's denoising step, and model idioms."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..frontend.pipeline_inputs import cogvideox_rotary, h3_inputs

TINY_H3 = dict(
    num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1, ffn_dim=96,
    in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=48,
    time_embed_dim=32, rope_freq_dim=2,
)


def tiny_h3(seed: int = 0, **overrides):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    return MiniMaxH3Transformer3DModel(**{**TINY_H3, **overrides}).eval()


def tiny_flux(seed: int = 0, heads: int = 4):
    """A small Flux (MMDiT: one double-stream and one single-stream block; ``heads`` x 16), random weights."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)).eval()


def with_lora(model: nn.Module, targets=("to_q", "to_k", "to_v", "to_out.0"), rank: int = 4,
              seed: int = 3) -> nn.Module:
    """``model`` prepared for LoRA fine-tuning as a training script does: its weights frozen, peft adapters of
    ``rank`` on the ``targets`` projections (the only weights that require grad). B is drawn at random instead of
    peft's zeros, so that A's gradients are not zero."""
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)), model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return model


def flux_inputs(seed: int = 1) -> dict:
    """16 image rows and 8 text rows (a joint sequence of 24)."""
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.randn(8, 3, generator=g))


def flux_cfg_inputs() -> dict:
    """Flux inputs with classifier-free guidance's two halves as a batch of 2 (the rotary ids have no batch)."""
    inputs = flux_inputs()
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inputs[name] = torch.cat([inputs[name], torch.randn_like(inputs[name])])
    inputs["timestep"] = torch.tensor([0.5, 0.25])
    return inputs



# --- models that rotate q/k in place (CogVideoX, CogView4: `query[:, :, text:] = rotary(...)`) ---------------

TINY_COGVIDEOX = dict(
    num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
    text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
    max_text_seq_length=8, use_rotary_positional_embeddings=True,
)

TINY_COGVIEW4 = dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
    text_embed_dim=32, time_embed_dim=32, condition_dim=8, pos_embed_max_size=8, sample_size=8,
    rope_axes_dim=(8, 8),
)


def tiny_cogvideox(seed: int = 0, **overrides):
    """A small CogVideoX 1.0 (rotary; 2 blocks; 4 heads x 16), random weights."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(**{**TINY_COGVIDEOX, **overrides}).eval()


def cogvideox_inputs(model, *, text: int = 8, frames: int = 4, height: int = 4, width: int = 4, batch: int = 1,
                     rotary: bool = True, seed: int = 1) -> dict:
    """Latent video (batch, frames, C, height, width) and `text` rows: frames*(height/p)*(width/p) video rows
    (16 by default, a joint sequence of 24); e.g. frames=3, height=2, width=6 gives 9 (joint 17)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(hidden_states=torch.randn(batch, frames, cfg.in_channels, height, width, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, cfg.text_embed_dim, generator=g),
                  timestep=torch.randint(0, 1000, (batch,), generator=g))
    if rotary:
        kwargs["image_rotary_emb"] = cogvideox_rotary(cfg, frames, height, width)
    return kwargs


def tiny_cogview4(seed: int = 0, **overrides):
    """A small CogView4 (2 blocks; 4 heads x 16), random weights."""
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(seed)
    return CogView4Transformer2DModel(**{**TINY_COGVIEW4, **overrides}).eval()


def cogview4_inputs(model, *, text: int = 8, height: int = 8, width: int = 8, batch: int = 1, rotary: bool = False,
                    text_mask: bool = False, seed: int = 1) -> dict:
    """Latent image (batch, C, height, width) and `text` rows: (height/p)*(width/p) image rows (16 by default, a joint
    sequence of 24). The pipeline lets the model build its rotary table (rotary=False); rotary=True passes the same
    table in. text_mask=True adds a (batch, text) padding mask (last text row padded), the processor's masked path."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([[height * 8.0, width * 8.0]]).expand(batch, 2)
    kwargs = dict(hidden_states=torch.randn(batch, cfg.in_channels, height, width, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, cfg.text_embed_dim, generator=g),
                  timestep=torch.rand(batch, generator=g) * 1000, original_size=size.clone(),
                  target_size=size.clone(), crop_coords=torch.zeros(batch, 2))
    if rotary:
        with torch.no_grad():
            kwargs["image_rotary_emb"] = model.rope(kwargs["hidden_states"])
    if text_mask:
        mask = torch.ones(batch, text, dtype=torch.int64)
        mask[:, -1] = 0
        kwargs["attention_mask"] = mask
    return kwargs



# A realistic packed length for full-size H3: 512 text rows, 36864 video rows (e.g. 32 frames of 48 x 24 patches),
# 512 audio rows: 37888 in all.
FULL_H3_ROWS = dict(text=512, video=36864, audio=512)


def full_h3_on_meta(timesteps: int = 2):
    """Full-size MiniMax-H3 (33B parameters) on the meta device, and meta inputs of a realistic packed length."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel()
    return model, h3_inputs(dict(model.config), **FULL_H3_ROWS, timesteps=timesteps, device="meta")


class H3DenoiseStep(torch.nn.Module):
    """One denoising step as MiniMax-H3's pipeline runs it: build the row timestep plan exactly as diffusers'
    ``build_row_timesteps`` does (one timestep per row, reduced with ``torch.unique(sorted=True,
    return_inverse=True)``), then call the transformer. ``step_timesteps`` holds this step's video, audio,
    video-conditioning and audio-reference timesteps, so one trace serves every step."""

    def __init__(self, transformer, num_condition_video_rows: int = 4, num_condition_audio_rows: int = 2,
                 check_bound: bool = True):
        super().__init__()
        self.transformer = transformer
        self.num_condition_video_rows, self.num_condition_audio_rows = num_condition_video_rows, num_condition_audio_rows
        self.check_bound = check_bound

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, token_tags, position_ids,
                video_indices, audio_indices, text_indices, step_timesteps):
        video, audio, condition_video, condition_audio = step_timesteps.unbind()
        row_timesteps = video.expand(token_tags.shape[0]).clone()
        row_timesteps[video_indices[: self.num_condition_video_rows]] = condition_video
        row_timesteps[audio_indices[self.num_condition_audio_rows:]] = audio
        row_timesteps[audio_indices[: self.num_condition_audio_rows]] = condition_audio
        timestep, timestep_indices = torch.unique(row_timesteps, sorted=True, return_inverse=True)
        if self.check_bound:
            torch._check(timestep.shape[0] <= 4)  # four timesteps per step at most
        return self.transformer(
            hidden_states=hidden_states, audio_hidden_states=audio_hidden_states,
            encoder_hidden_states=encoder_hidden_states, timestep=timestep, timestep_indices=timestep_indices,
            token_tags=token_tags, position_ids=position_ids, video_indices=video_indices,
            audio_indices=audio_indices, text_indices=text_indices, return_dict=False)


def denoise_inputs(config: dict, step_timesteps) -> dict:
    """``h3_inputs`` for ``H3DenoiseStep``: the layout, and this step's four timesteps instead of the plan."""
    inputs = h3_inputs(config)
    del inputs["timestep"], inputs["timestep_indices"]
    return dict(inputs, step_timesteps=torch.tensor(step_timesteps, dtype=torch.float32))


# --- model idioms beyond H3 and Flux ---------------------------------------------------------------------------

class SplitSwiGLU(nn.Module):
    """A fused [value; gate] projection cut with `split` rather than `chunk`."""

    def __init__(self, sizes_list: bool):
        super().__init__()
        self.proj, self.down, self.sizes_list = nn.Linear(16, 32), nn.Linear(16, 16), sizes_list

    def forward(self, x):
        value, gate = self.proj(x).split([16, 16] if self.sizes_list else 16, dim=-1)
        return self.down(value * F.silu(gate))


class JointAttention(nn.Module):
    """Two streams projected apart, joined along the sequence, heads split with unflatten(heads, -1)."""

    def __init__(self, heads=4, dim=32):
        super().__init__()
        self.heads = heads
        self.qkv_a, self.qkv_b = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, a, b):
        qa, ka, va = self.qkv_a(a).chunk(3, -1)
        qb, kb, vb = self.qkv_b(b).chunk(3, -1)
        q, k, v = (torch.cat([x.unflatten(-1, (self.heads, -1)), y.unflatten(-1, (self.heads, -1))], 1).transpose(1, 2)
                   for x, y in ((qa, qb), (ka, kb), (va, vb)))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class LikeOps(nn.Module):
    """`zeros_like` of a column-sharded value takes its shape from it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.where(h > 0, h, torch.zeros_like(h)))


class ViewHeads(nn.Module):
    """Heads split with view(B, S, heads, -1), as older diffusers processors do."""

    def __init__(self, heads=4, dim=32):
        super().__init__()
        self.heads, self.q, self.k, self.v, self.o = heads, *(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MaskedAttention(ViewHeads):
    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, -1))


class ConvLinearAttentionBlock(nn.Module):
    """Sana's op families in a block of our own: a linear attention spelled out with matmuls (ReLU kernel, a row of
    ones padded onto the values for the normaliser), a cross-attention to text rows, and a convolutional
    feed-forward (1x1 -> 3x3 depthwise -> gated halves -> 1x1) over the image its ``height`` x ``width`` rows make.
    With ``key_sum`` the normaliser is written as diffusers' Sana processors write it: the keys summed over the
    rows (``k.sum``), then multiplied by the queries."""

    def __init__(self, dim=32, heads=4, hidden=24, height=6, width=6, key_sum=False):
        super().__init__()
        self.heads, self.height, self.width, self.key_sum = heads, height, width, key_sum
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.cross_q, self.cross_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(16, 2 * dim)
        self.expand = nn.Conv2d(dim, 2 * hidden, 1)
        self.mix = nn.Conv2d(2 * hidden, 2 * hidden, 3, padding=1, groups=2 * hidden)
        self.project = nn.Conv2d(hidden, dim, 1, bias=False)
        self.norm = nn.LayerNorm(dim)

    def attention(self, x):
        q, k, v = (t.transpose(1, 2).unflatten(1, (self.heads, -1)) for t in (self.q(x), self.k(x), self.v(x)))
        q, k = F.relu(q), F.relu(k).transpose(2, 3)
        if self.key_sum:  # [b, heads, d, rows] @ [b, heads, rows, d] @ [b, heads, d, rows]
            return self.out(((v @ k) @ q / (k.sum(2, keepdim=True) @ q + 1e-15)).flatten(1, 2).transpose(1, 2))
        v = F.pad(v, (0, 0, 0, 1), value=1.0)
        out = (v @ k) @ q
        out = out[:, :, :-1] / (out[:, :, -1:] + 1e-15)
        return self.out(out.flatten(1, 2).transpose(1, 2))

    def feed_forward(self, x):
        image = x.unflatten(1, (self.height, self.width)).permute(0, 3, 1, 2)
        value, gate = self.mix(F.silu(self.expand(image))).chunk(2, dim=1)
        return self.project(value * F.silu(gate)).flatten(2).transpose(1, 2)

    def cross_attention(self, x, text):
        q = self.cross_q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.cross_kv(text).chunk(2, dim=-1))
        return self.cross_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))

    def forward(self, x, text):
        x = x + self.attention(self.norm(x))
        x = x + self.cross_attention(self.norm(x), text)
        return x + self.feed_forward(self.norm(x))


class SpatialTemporalBlock(nn.Module):
    """A factorised video block as Latte writes one: attention within each frame (frames folded into the batch:
    ``[batch * frames, positions, dim]``), then across frames at each position (positions folded into the batch:
    ``[batch * positions, frames, dim]``), then cross-attention to text rows repeated for every frame."""

    def __init__(self, frames=4, positions=6, heads=4, dim=32):
        super().__init__()
        self.frames, self.positions = frames, positions
        self.spatial, self.temporal = ViewHeads(heads, dim), ViewHeads(heads, dim)
        self.cross_q, self.cross_kv, self.cross_out = nn.Linear(dim, dim), nn.Linear(16, 2 * dim), nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x, text):  # x: [batch * frames, positions, dim], text: [batch, text rows, 16]
        x = x + self.spatial(x)
        by_position = x.unflatten(0, (-1, self.frames)).transpose(1, 2).flatten(0, 1)
        by_position = by_position + self.temporal(by_position)
        x = by_position.unflatten(0, (-1, self.positions)).transpose(1, 2).flatten(0, 1)
        k, v = (t.repeat_interleave(self.frames, 0).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                for t in self.cross_kv(text).chunk(2, dim=-1))
        q = self.cross_q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        return x + self.cross_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def idiom_cases() -> dict:
    """Small models written the ways people write fused projections, joint attention, masks and reshapes:
    name -> (model factory, forward kwargs)."""
    g = torch.Generator().manual_seed(0)
    x = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "split_sizes": (lambda: SplitSwiGLU(True), {"x": x(2, 3, 16)}),
        "split_size": (lambda: SplitSwiGLU(False), {"x": x(2, 3, 16)}),
        "joint_unflatten": (JointAttention, {"a": x(1, 5, 32), "b": x(1, 3, 32)}),
        "zeros_like": (LikeOps, {"x": x(3, 8)}),
        "view_heads_odd_rows": (ViewHeads, {"x": x(1, 5, 32)}),
        # a per-head mask that hides about half the keys (never a row's own): wrong rows or heads would show
        "masked": (MaskedAttention, {"x": x(1, 6, 32), "mask": (x(1, 4, 6, 6) > 0) | torch.eye(6, dtype=torch.bool)}),
        # 8 x 6 image rows: 2 per rank over 4 ranks, each borrowing a row from each neighbour
        "conv_linear_attention": (lambda: ConvLinearAttentionBlock(height=8), {"x": x(1, 48, 32), "text": x(1, 5, 16)}),
    }


__all__ = ['ConvLinearAttentionBlock', 'FULL_H3_ROWS', 'H3DenoiseStep', 'JointAttention', 'LikeOps', 'MaskedAttention', 'SpatialTemporalBlock', 'SplitSwiGLU', 'TINY_COGVIDEOX', 'TINY_COGVIEW4', 'TINY_H3', 'ViewHeads', 'cogvideox_inputs', 'cogvideox_rotary', 'cogview4_inputs', 'denoise_inputs', 'flux_cfg_inputs', 'flux_inputs', 'full_h3_on_meta', 'h3_inputs', 'idiom_cases', 'tiny_cogvideox', 'tiny_cogview4', 'tiny_flux', 'tiny_h3', 'with_lora']
