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


def tiny_qwen_image_vae(seed: int = 0):
    """AutoencoderKLQwenImage (Qwen-Image and its edit pipelines): Wan 2.1's causal 3D VAE, decoding one frame."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                                  attn_scales=[], latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()


def tiny_minimax_h3_vae(seed: int = 0):
    """AutoencoderKLMiniMaxH3's decoder: a ViT over every latent voxel (plus register tokens at position 0) with 3-axis
    rope, full attention, each token unpatchified into a 2x4x4 pixel block; decode runs in overlapping temporal
    chunks (clip_length 5, token_drop 1: latents of 3n + 2 frames). Its zero-initialised layer scales and register
    tokens are drawn at random so the blocks count in the output."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(seed)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=(8, 8), layers_per_block=1, spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(1, 2), norm_num_groups=4, decoder_num_layers=2, decoder_num_attention_heads=2,
        decoder_attention_head_dim=16, decoder_num_register_tokens=2, decoder_ffn_mult=2, clip_length=5,
        token_drop=1, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    with torch.no_grad():
        for parameter in vae.parameters():
            if not parameter.any():
                parameter.normal_(std=0.3)
    return vae.eval()


def tiny_minimax_h3_audio_vae(seed: int = 0):
    """AutoencoderKLMiniMaxH3Audio, H3's audio VAE (as the H3 pipeline test builds it): 1D convolutions over time,
    weight-normed, upsampling by transposed convolutions; no attention."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(seed)
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 2), latent_dim=8, latent_channels=8, num_attention_heads=1, decoder_dim=8,
        decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), latents_mean=[0.0] * 8, latents_std=[1.0] * 8).eval()


def tiny_dc_ae(seed: int = 0):
    """AutoencoderDC (Sana): ResNet levels, then EfficientViT blocks (ReLU linear attention over every pixel, a
    multi-scale 5 x 5 depthwise aggregation of q, k, v), 1 x 1 convolutions, pixel-shuffle upsampling."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    return AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=4, encoder_block_types=("ResBlock",) * 2 +
        ("EfficientViTBlock",), decoder_block_types=("ResBlock",) * 2 + ("EfficientViTBlock",),
        encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        upsample_block_type="pixel_shuffle", downsample_block_type="pixel_unshuffle",
        decoder_norm_types=("batch_norm", "batch_norm", "rms_norm"), decoder_act_fns=("relu", "relu", "silu"),
        scaling_factor=0.41).eval()


class PaddedNet(torch.nn.Module):
    """The padding and resampling idioms of convolutional decoders and encoders in one small network: reflect and
    replicate padding (H3's encoder, BigVGAN's filters), a strided convolution after replicate padding,
    space-to-depth and depth-to-space (``pixel_unshuffle`` / ``pixel_shuffle``), a transposed convolution, bilinear
    and bicubic upsampling."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.reflected = torch.nn.Conv2d(channels, channels, 3)
        self.replicated = torch.nn.Conv2d(channels, channels, 3, stride=(2, 1))
        self.mixed = torch.nn.Conv2d(4 * channels, 4 * channels, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(channels, channels, (4, 3), stride=(2, 1), padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        x = self.reflected(F.pad(x, (1, 1, 1, 1), mode="reflect"))
        x = self.replicated(F.pad(x, (1, 1, 1, 1), mode="replicate"))  # rows halved
        x = F.pixel_shuffle(self.mixed(F.pixel_unshuffle(x, 2)), 2)
        x = self.up(F.silu(x))  # rows doubled back
        return F.interpolate(x, scale_factor=2, mode="bilinear") + F.interpolate(x, scale_factor=2, mode="bicubic")


def tiny_padded_net(seed: int = 0):
    torch.manual_seed(seed)
    return PaddedNet().eval()


VAES = {"autoencoder_kl": tiny_autoencoder_kl, "wan": tiny_wan_vae, "qwen_image": tiny_qwen_image_vae,
        "minimax_h3": tiny_minimax_h3_vae, "minimax_h3_audio": tiny_minimax_h3_audio_vae, "dc_ae": tiny_dc_ae}
# latent frames (None: an image VAE; 0: an audio VAE, whose latent is [batch, channels, time])
FRAMES = {"autoencoder_kl": None, "wan": 2, "qwen_image": 1, "minimax_h3": 5, "minimax_h3_audio": 0,
          "dc_ae": None}


def latents(name: str, height: int, width: int, seed: int = 3, frames: int | None = None) -> torch.Tensor:
    """A latent of ``height`` rows (an audio VAE's: ``height`` time steps, 8 channels)."""
    frames = frames or FRAMES[name]
    shape = ((1, 4, height, width) if FRAMES[name] is None else (1, 8, height) if FRAMES[name] == 0
             else (1, 4, frames, height, width))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def images(name: str, height: int, width: int, seed: int = 4, frames: int = 5) -> torch.Tensor:
    """What ``encode`` takes: an image (a video of ``frames`` frames for a video VAE)."""
    shape = (1, 3, height, width) if FRAMES[name] is None else (1, 3, frames, height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def encode_on_ranks(rank: int, world: int, name: str, height: int, width: int):
    """On every rank: the VAE's encode partitioned over a ring of ``world`` (image rows split along height, in
    whole groups of the downsampling strides) against the whole encode; (max error of the latent distribution's
    mean and std, max magnitude, halo convolutions)."""
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    vae, x = VAES[name](), images(name, height, width)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ring",))
    partitioned = partitioner.partition(vae, mesh, ((x,), {}), method="encode")
    with torch.no_grad():
        out, expected = partitioned.compile()(x).latent_dist, vae.encode(x).latent_dist
    error = max((out.mean - expected.mean).abs().max().item(), (out.std - expected.std).abs().max().item())
    return error, expected.mean.abs().max().item(), partitioned.collective_counts()[("halo_exchange", "ring")]


def small_tiles(vae, tile: int) -> dict:
    """``enable_tiling``'s arguments for square tiles of ``tile`` pixels overlapping by half: diffusers' VAEs give
    the overlap either as such (MiniMax-H3) or as the stride between tiles (Wan, Qwen-Image)."""
    import inspect

    step = "min_overlap" if "tile_sample_min_overlap_height" in inspect.signature(vae.enable_tiling).parameters \
        else "stride"
    return {"tile_sample_min_height": tile, "tile_sample_min_width": tile,
            f"tile_sample_{step}_height": tile // 2, f"tile_sample_{step}_width": tile // 2}


def decode_on_ranks(rank: int, world: int, name: str, height: int, width: int, break_halo: bool = False,
                    tile: int | None = None, local_norms: bool = False):
    """On every rank: the VAE's decode partitioned over a ring of ``world`` (rows split along height) against the
    whole decode; (max error, max magnitude, halo convolutions, sharded group norms, ring attentions).
    ``break_halo``: the negative control, every halo exchange's borrowed rows replaced by zeros (the convolutions'
    padding). ``local_norms``: the other negative control, every group norm normalising with this rank's
    statistics alone. ``tile``: the VAE's own tiled decode, tiles of ``tile`` pixels overlapping by half (the partitioned
    decode follows the tiles)."""
    from collections import Counter

    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.runtime import collectives

    vae = VAES[name]()
    if tile:
        vae.enable_tiling(**small_tiles(vae, tile))
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
    if local_norms:
        for node in partitioned.graph_module.graph.nodes:
            if node.target is collectives.sharded_group_norm:
                node.target, node.args = torch.ops.aten.group_norm.default, node.args[:5]
    if break_halo or local_norms:
        partitioned.graph_module.recompile()
    out = partitioned.compile()(z, return_dict=False)[0]
    with torch.no_grad():
        expected = vae.decode(z).sample
    return ((out - expected).abs().max().item(), expected.abs().max().item(), kernels["halo_convolution"],
            kernels["sharded_group_norm"], kernels["ring_attention"])


def padded_net_on_ranks(rank: int, world: int, height: int, width: int):
    """On every rank: ``PaddedNet`` partitioned over a ring of ``world`` (no attention: every convolution's input
    split along height) against the whole network; (max error, max magnitude, halo exchanges, gathers)."""
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner

    net = tiny_padded_net()
    x = torch.randn(1, 4, height, width, generator=torch.Generator().manual_seed(3))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ring",))
    partitioned = partitioner.partition(net, mesh, ((x,), {}))
    counts = partitioned.collective_counts()
    with torch.no_grad():
        out, expected = partitioned.compile()(x), net(x)
    return ((out - expected).abs().max().item(), expected.abs().max().item(), counts[("halo_exchange", "ring")],
            counts[("all_gather", "ring")])


def decode_peak_on_ranks(rank: int, world: int, height: int, width: int) -> dict:
    """On every rank: the measured activation peak of one partitioned decode of a 2-level AutoencoderKL (16 and
    32 channels; the least of three decodes, as ``benchmarks/vae_memory.py``) and the report's estimate."""
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing import peak_allocated_bytes

    torch.set_num_threads(1)
    vae, z = tiny_autoencoder_kl(channels=(16, 32)), latents("autoencoder_kl", height, width)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ring",))
    partitioned = partitioner.partition(vae, mesh, ((z,), {"return_dict": False}), method="decode")
    decode = partitioned.compile()
    with torch.no_grad():
        decode(z, return_dict=False)
        measured = min(peak_allocated_bytes(lambda: decode(z, return_dict=False)) for _ in range(3))
    return dict(measured=measured, estimate=partitioned.report().activation_peak_bytes)
