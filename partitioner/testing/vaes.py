"""Tiny VAEs from diffusers with random weights, and a check of a partitioned decode on gloo ranks against the
single-device decode (tests/test_vae.py, benchmarks/vae_memory.py)."""

from __future__ import annotations

import torch


def tiny_autoencoder_kl(seed: int = 0, channels: tuple[int, ...] = (8, 16), latent: int = 4):
    """AutoencoderKL as Flux and SD3 use it (here 2 levels: one 2x nearest upsampling; mid-block attention)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(channels),
                         up_block_types=("UpDecoderBlock2D",) * len(channels), block_out_channels=channels,
                         layers_per_block=1, latent_channels=latent, norm_num_groups=4, sample_size=32).eval()


def tiny_wan_vae(seed: int = 0):
    """AutoencoderKLWan: causal 3D convolutions (padded in time on one side), frame-by-frame decode with its
    feature cache, RMS norms over channels, nearest-exact upsampling, a per-frame mid-block attention."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                            attn_scales=[]).eval()


VAES = {"autoencoder_kl": tiny_autoencoder_kl, "wan": tiny_wan_vae}


def latents(name: str, height: int, width: int, seed: int = 3, frames: int = 2) -> torch.Tensor:
    shape = (1, 4, height, width) if name == "autoencoder_kl" else (1, 4, frames, height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def decode_on_ranks(rank: int, world: int, name: str, height: int, width: int, break_halo: bool = False):
    """On every rank: the VAE's decode partitioned over a ring of ``world`` (rows split along height) against the
    whole decode; (max error, max magnitude, halo convolutions, sharded group norms). ``break_halo``: the negative
    control, every halo exchange's borrowed rows replaced by zeros (the convolutions' padding)."""
    from collections import Counter

    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.runtime import collectives

    vae = VAES[name]()
    z = latents(name, height, width)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ring",))
    partitioned = partitioner.partition(vae, mesh, ((z,), {"return_dict": False}), method="decode")
    kernels = Counter(getattr(n.target, "__name__", "") for n in partitioned.graph_module.graph.nodes)
    if break_halo:
        for node in partitioned.graph_module.graph.nodes:
            if node.target is collectives.halo_convolution:
                x, weight, bias, stride, padding, dilation, groups = node.args[:7]
                node.target = collectives.padded_convolution
                node.args = (x, weight, bias, stride, padding, dilation, groups)
        partitioned.graph_module.recompile()
    out = partitioned.compile()(z, return_dict=False)[0]
    with torch.no_grad():
        expected = vae.decode(z).sample
    return ((out - expected).abs().max().item(), expected.abs().max().item(), kernels["halo_convolution"],
            kernels["sharded_group_norm"])
