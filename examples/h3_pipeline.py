"""diffusers' own MiniMax-H3 denoising loop driving a partitioned transformer, checked against the unpartitioned one.

    python examples/h3_pipeline.py [--tp 2] [--ulysses 2] [--steps 4]
    torchrun --nproc-per-node 4 examples/h3_pipeline.py --tp 2 --ulysses 2

Every rank builds the same tiny random H3 and the same packed layout, then runs diffusers' denoising blocks
(``MiniMaxH3LoopDenoiser`` and ``MiniMaxH3LoopSchedulerStep``, with the row timestep plan of
``MiniMaxH3SetTimestepsStep.build_row_timesteps``) for a few steps twice: once with the transformer swapped by
``partitioner.parallelize`` on a (tp, ulysses) mesh, once with the transformer itself. Conditioning rows stay at
timestep 0, so each step's plan has 2 or 3 distinct timesteps: the partition, made at the first step with the
timestep table bucketed to 4 rows (its padding is proven unread), serves every step with one program. Prints the
largest difference of the final latents.
"""

from __future__ import annotations

import argparse
import copy
from types import SimpleNamespace

import torch

import partitioner
from partitioner.testing import TINY_H3, h3_inputs, launch, tiny_h3

CONDITION_VIDEO_ROWS, CONDITION_AUDIO_ROWS = 4, 2


def denoise(transformer, inputs: dict, steps: int):
    """The loop of diffusers' H3 modular pipeline: per step, the row timestep plan, the transformer, the schedulers."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser, MiniMaxH3LoopSchedulerStep
    from diffusers.modular_pipelines.modular_pipeline import BlockState
    from diffusers.schedulers import MiniMaxH3Scheduler

    components = SimpleNamespace(transformer=transformer, scheduler=MiniMaxH3Scheduler(),
                                 audio_scheduler=MiniMaxH3Scheduler())
    components.scheduler.set_timesteps(steps)
    components.audio_scheduler.set_timesteps(steps)
    timesteps, audio_timesteps = components.scheduler.timesteps, components.audio_scheduler.timesteps
    plan = [MiniMaxH3SetTimestepsStep.build_row_timesteps(
        inputs["video_indices"], inputs["audio_indices"], CONDITION_VIDEO_ROWS, CONDITION_AUDIO_ROWS,
        inputs["text_indices"].numel(), float(t), float(a), 0.0, 0.0) for t, a in zip(timesteps, audio_timesteps)]
    state = BlockState(latents=inputs["hidden_states"][0].clone(), audio_latents=inputs["audio_hidden_states"][0].clone(),
                       prompt_embeds=inputs["encoder_hidden_states"], row_timestep_plan=plan, attention_kwargs=None,
                       audio_timesteps=audio_timesteps, num_condition_video_rows=CONDITION_VIDEO_ROWS,
                       num_condition_audio_rows=CONDITION_AUDIO_ROWS,
                       denoiser_input_fields={name: inputs[name] for name in
                                              ("token_tags", "position_ids", "video_indices", "audio_indices",
                                               "text_indices")})
    distinct = []
    for i, t in enumerate(timesteps):
        components, state = MiniMaxH3LoopDenoiser()(components, state, i, t)
        components, state = MiniMaxH3LoopSchedulerStep()(components, state, i, t)
        distinct.append(plan[i][0].numel())
    return state.latents, state.audio_latents, distinct


def run_rank(rank: int, world: int, tp: int, ulysses: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    mesh = init_device_mesh("cpu", (tp, ulysses), mesh_dim_names=("tp", "ulysses"))
    pipe = partitioner.parallelize(SimpleNamespace(transformer=copy.deepcopy(model)), mesh, buckets={"timestep": 4})
    video, audio, distinct = denoise(pipe.transformer, inputs, steps)
    expected_video, expected_audio, _ = denoise(model, inputs, steps)
    return dict(error=max((video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()),
                distinct=distinct, specializations=len(pipe.transformer.specializations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    results = launch(args.tp * args.ulysses, run_rank, args.tp, args.ulysses, args.steps)
    if results is None:  # torchrun: rank 0 reports
        return
    print(f"tiny MiniMax-H3, diffusers' denoising loop, {args.steps} steps, TP={args.tp} x Ulysses={args.ulysses}; "
          f"distinct timesteps per step {results[0]['distinct']}, shape specialisations "
          f"{results[0]['specializations']}")
    for rank, result in enumerate(results):
        print(f"rank {rank}: max |partitioned - single device| of the final latents {result['error']:.2e}")
    worst = max(r["error"] for r in results)
    if worst > 1e-4:
        raise SystemExit(f"mismatch: {worst:.2e} > 1e-4")


if __name__ == "__main__":
    main()
