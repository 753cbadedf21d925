"""What the per-call input fingerprint costs, against a step (``partition(..., input_fingerprint=)``).

    python benchmarks/fingerprint_cost.py [--repeats 20]            # 2 gloo ranks, TP=2: tiny and mid-size H3
    python benchmarks/fingerprint_cost.py --device cuda             # the fingerprint alone on a GPU, real shapes

On gloo ranks it prints, for tiny H3 and the mid-size H3 of ``tp_step.py`` at TP=2, the median step with
``input_fingerprint`` "off", "sample" (the default) and "full", and the fingerprint alone (``fingerprints.fingerprints``
on the call's inputs, the median of many): its share of the step is the cost. With ``--device cuda`` it times the
fingerprint alone (one host transfer included) of the inputs of real pipelines' denoiser calls on the GPU. Timings
on a shared machine are noisy: the fingerprint alone is the figure to read; the step rows bound it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tp_step import MID, ROWS, _inputs, _model, _time  # noqa: E402  (the same mid-size model and timing)


def _alone(values, mode: str, repeats: int, synchronise=lambda: None) -> float:
    from partitioner.runtime.fingerprints import fingerprints

    for _ in range(3):
        fingerprints(values, mode)
    times = []
    for _ in range(repeats):
        synchronise()
        start = time.perf_counter()
        fingerprints(values, mode)  # (ends with the sums on the host: no synchronise needed after it)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, repeats: int) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner import partition
    from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

    rows = []
    for name, model, inputs in (("tiny H3", tiny_h3(), h3_inputs(TINY_H3)),
                                ("mid-size H3", _model(MID), _inputs(MID, ROWS))):
        partitioned = partition(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), ((), inputs))
        compiled = partitioned.compile()
        steps = {}
        for mode in ("off", "sample", "full", "off", "sample"):  # twice, interleaved: drift shows
            partitioned.input_fingerprint = mode
            steps.setdefault(mode, []).append(_time(lambda: compiled(**inputs), repeats, dist.barrier))
        values = [(key, value) for key, value in inputs.items()]
        rows.append((name, {mode: min(times) for mode, times in steps.items()},
                     _alone(values, "sample", repeats * 10), _alone(values, "full", repeats * 10)))
    return rows


def _gpu(repeats: int) -> None:
    device = torch.device("cuda")
    shapes = {  # a denoiser call's tensor inputs
        "Flux 1024x1024": dict(hidden_states=(1, 4096, 64), encoder_hidden_states=(1, 512, 4096),
                               pooled_projections=(1, 768), timestep=(1,), guidance=(1,), img_ids=(4096, 3),
                               txt_ids=(512, 3)),
        "Wan 480p 81 frames": dict(hidden_states=(1, 16, 21, 60, 104), encoder_hidden_states=(1, 512, 4096),
                                   timestep=(1,)),
    }
    for name, inputs in shapes.items():
        values = [(key, torch.randn(shape, device=device, dtype=torch.bfloat16)) for key, shape in inputs.items()]
        sample = _alone(values, "sample", repeats * 10, torch.cuda.synchronize)
        full = _alone(values, "full", repeats, torch.cuda.synchronize)
        print(f"{name} ({torch.cuda.get_device_name()}, bf16): fingerprint 'sample' {sample * 1e6:.0f} us, "
              f"'full' {full * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args()
    if options.device == "cuda":
        _gpu(options.repeats)
        return
    from partitioner.testing import run_ranks

    for name, steps, sample, full in run_ranks(2, _rank, options.repeats)[0]:
        print(f"{name}, TP=2 on 2 gloo ranks: step " + ", ".join(f"{mode} {t * 1e3:.1f} ms" for mode, t in steps.items())
              + f"; fingerprint alone: 'sample' {sample * 1e6:.0f} us ({100 * sample / steps['off']:.2f}% of the "
              f"step), 'full' {full * 1e6:.0f} us ({100 * full / steps['off']:.2f}%)")


if __name__ == "__main__":
    main()
