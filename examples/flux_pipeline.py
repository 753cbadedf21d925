"""A real diffusers FluxPipeline, from the prompt to the decoded image, with its transformer partitioned.

    python examples/flux_pipeline.py [--tp 2] [--ulysses 2] [--steps 4]                  # spawns tp x ulysses local ranks
    torchrun --standalone --nproc-per-node 4 examples/flux_pipeline.py --tp 2 --ulysses 2  # one process per rank
    python examples/flux_pipeline.py --model /path/to/FLUX.1-dev --height 1024 --width 1024

Every rank builds the same pipeline: by default a tiny random one (CLIP and T5 text encoders with tokenizers over a
small vocabulary, a one-level VAE, a 2 + 2 block Flux; ``partitioner.testing.pipelines``), or with ``--model`` a
pipeline folder whose transformer is built on the meta device and read shard by shard (each rank reads only its
slices of the checkpoint; text encoders and VAE are loaded whole). ``partitioner.parallelize(pipe, mesh)`` swaps the
transformer for a module that partitions it at the first denoising step and serves every later one. Each rank then
compares every step's latents and the decoded image with the unpartitioned pipeline's (built on every rank:
``--no-reference`` skips it for a model too large for one device) and reports the time per denoising step.
"""

from __future__ import annotations

import argparse
import os
import time

# transformers warns at import that its image processors fall back without torchvision (unused here): quiet
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import partitioner  # noqa: E402
from partitioner.testing import launch  # noqa: E402


def build(model: str | None, meta_transformer: bool):
    """The tiny random FluxPipeline, or the one in ``model`` (with its transformer on meta to be read shard by
    shard when ``meta_transformer``)."""
    if model is None:
        from partitioner.testing.pipelines import tiny_flux_pipeline

        return tiny_flux_pipeline()
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from diffusers.utils import logging
    from transformers.utils import logging as transformers_logging

    logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    components = {}
    if meta_transformer:
        with torch.device("meta"):
            components["transformer"] = FluxTransformer2DModel.from_config(
                FluxTransformer2DModel.load_config(model, subfolder="transformer"))
    pipe = FluxPipeline.from_pretrained(model, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, args, seed: int = 0):
    """Every step's latents, the decoded image and the seconds each step took (as ``callback_on_step_end`` sees
    them)."""
    latents, stamps = [], [time.perf_counter()]

    def record(pipeline, step, timestep, tensors):
        latents.append(tensors["latents"].detach().clone())
        stamps.append(time.perf_counter())
        return {}

    image = pipe(prompt=args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
                 max_sequence_length=args.max_sequence_length, guidance_scale=3.5, output_type="pt",
                 generator=torch.Generator().manual_seed(seed), callback_on_step_end=record).images
    return latents, image, [b - a for a, b in zip(stamps, stamps[1:])]


def run_rank(rank: int, world: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.tp, args.ulysses), mesh_dim_names=("tp", "ulysses"))
    pipe = partitioner.parallelize(build(args.model, meta_transformer=args.model is not None), mesh,
                                   checkpoint=args.model)
    latents, image, seconds = generate(pipe, args)
    result = dict(seconds=seconds, attention=pipe.transformer.partitioned.ctx.sequence_attention)
    if args.reference:
        expected_latents, expected_image, reference_seconds = generate(build(args.model, meta_transformer=False), args)
        result.update(latents=max((a - b).abs().max().item() for a, b in zip(latents, expected_latents)),
                      image=(image - expected_image).abs().max().item(), reference_seconds=reference_seconds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default=None, help="a FluxPipeline folder (default: a tiny random pipeline)")
    parser.add_argument("--prompt", default="a photo of a cat")
    parser.add_argument("--height", type=int, default=12)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--max-sequence-length", type=int, default=12)
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the unpartitioned pipeline (it holds the whole model on every rank)")
    args = parser.parse_args()
    results = launch(args.tp * args.ulysses, run_rank, args)
    if results is None:  # torchrun: rank 0 reports
        return
    sharded = sum(why.sharded for why in results[0]["attention"].values())
    print(f"FluxPipeline ({args.model or 'tiny, random'}), {args.height}x{args.width}, {args.steps} steps, "
          f"TP={args.tp} x Ulysses={args.ulysses}"
          + (f"; attentions sequence-sharded: {sharded}/{len(results[0]['attention'])}" if args.ulysses > 1 else ""))
    worst = 0.0
    for rank, result in enumerate(results):
        steady = result["seconds"][1:] or result["seconds"]
        line = (f"rank {rank}: first step (partitions the transformer) {result['seconds'][0]:.2f} s, then "
                f"{1e3 * sum(steady) / len(steady):.1f} ms per step")
        if args.reference:
            reference = result["reference_seconds"][1:] or result["reference_seconds"]
            line += (f" (unpartitioned {1e3 * sum(reference) / len(reference):.1f} ms); max |partitioned - "
                     f"unpartitioned| latents {result['latents']:.2e}, image {result['image']:.2e}")
            worst = max(worst, result["latents"], result["image"])
        print(line)
    if worst > 1e-4:
        raise SystemExit(f"mismatch: {worst:.2e} > 1e-4")


if __name__ == "__main__":
    main()
