"""A tiny random MiniMax-H3 and its inputs, shared by tests and examples."""

from __future__ import annotations

import torch

TINY_H3 = dict(
    num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1, ffn_dim=96,
    in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=48,
    time_embed_dim=32, rope_freq_dim=2,
)


def tiny_h3(seed: int = 0, **overrides):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    return MiniMaxH3Transformer3DModel(**{**TINY_H3, **overrides}).eval()


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
