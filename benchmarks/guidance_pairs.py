"""Classifier-free guidance on a cfg axis for a pipeline that calls its denoiser twice a step, side by side in one
run on this machine.

    python benchmarks/guidance_pairs.py [--steps 6] [--repeats 3]

A tiny WanPipeline (its UMT5 encoder, VAE and scheduler; guidance 5: a conditional and an unconditional call a
step) with a mid-size transformer (8 heads x 48, 4 blocks; 256 x 256 pixels, 9 frames: 768 latent rows), run with ``--steps`` steps on two
gloo ranks (one thread each) at cfg=2 (``parallelize``: the two calls of a step computed at once, one per half)
and, in the same rank processes, unpartitioned (each rank runs the whole pipeline alone, both cores busy alike).
The runs alternate; each row is the median of ``--repeats`` (ranges shown). It prints the transformer calls each
rank computed out of the pipeline's (each call costs the same FLOPs, so that is the per-rank share of the
transformer's FLOPs; ideal ``(steps + 1) / (2 steps)``: both calls of the first step, one of each later step), the
fraction of second calls served, the pipeline's time and the max difference from the unpartitioned latents.
Timings on a shared 2-core machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SIZE = dict(height=256, width=256, num_frames=9)


def _pipeline():
    """The tiny WanPipeline with a mid-size transformer (8 heads x 48, 4 blocks: 768 latent rows at SIZE)."""
    from diffusers import WanTransformer3DModel

    from partitioner.testing.pipelines import BUILDERS

    pipe = BUILDERS["wan"]()
    torch.manual_seed(0)
    pipe.register_modules(transformer=WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=48, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=1024, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64).eval())
    return pipe


def _rank(rank: int, world: int, steps: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import partitioner
    from partitioner.testing.pipelines import run

    torch.set_num_threads(1)
    pipe, reference = _pipeline(), _pipeline()
    pipe = partitioner.parallelize(pipe, init_device_mesh("cpu", (world,), mesh_dim_names=("cfg",)), vae=False)
    timed = {"cfg=2 (pairs)": pipe, "unpartitioned": reference}
    seconds = {name: [] for name in timed}
    latents = {}
    run(pipe, "wan", num_inference_steps=steps, **SIZE)  # the partition and its first request
    pairs = pipe.transformer.guidance_pairs
    calls, served, paired = pairs.calls, pairs.served, pairs.paired
    for _ in range(repeats):
        for name, pipeline in timed.items():
            dist.barrier()
            start = time.perf_counter()
            latents[name] = run(pipeline, "wan", num_inference_steps=steps, **SIZE)[0]
            seconds[name].append(time.perf_counter() - start)
    error = max((a - b).abs().max().item() for a, b in zip(*latents.values()))
    return dict(seconds=seconds, computed=calls - served, calls=calls, served=served, paired=paired, error=error)


def main() -> None:
    from partitioner.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    results = run_ranks(2, _rank, options.steps, options.repeats)
    result = results[0]
    print(f"WanPipeline (mid-size transformer, {SIZE}), {options.steps} steps, guidance 5 (two calls a step), 2 gloo ranks")
    print(f"transformer calls computed per rank: {result['computed']} of {result['calls']} "
          f"({result['computed'] / result['calls']:.2f}; ideal {(options.steps + 1) / (2 * options.steps):.2f}); "
          f"pairs run {result['paired']}, second calls served {result['served']} of {result['calls'] // 2}")
    print("| layout | pipeline time, median (range) | x unpartitioned |")
    print("|---|---|---|")
    base = statistics.median(result["seconds"]["unpartitioned"])
    for name, seconds in result["seconds"].items():
        median = statistics.median(seconds)
        print(f"| {name} | {median * 1000:.0f} ms ({min(seconds) * 1000:.0f}-{max(seconds) * 1000:.0f}) | "
              f"{median / base:.2f} |")
    print(f"max |cfg=2 - unpartitioned| over every step's latents, every rank: "
          f"{max(r['error'] for r in results):.1e}")


if __name__ == "__main__":
    main()
