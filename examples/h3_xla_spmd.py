"""MiniMax-H3 through XLA SPMD: one process drives 4 virtual CPU devices, checked against the CPU model.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/h3_xla_spmd.py [--tp 2] [--ulysses 2]

The plan's placements become XLA sharding annotations; XLA's SPMD partitioner inserts the collectives, and the
first call checks its partitioned HLO against the plan (the same collectives, over the same device groups).
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections import Counter

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ notices (GSPMD's deprecation) are not ours to print

import torch  # noqa: E402

import partitioner  # noqa: E402
from partitioner.backends.xla import axis_of  # noqa: E402
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2)
    args = parser.parse_args()
    mesh = {name: size for name, size in (("tp", args.tp), ("ulysses", args.ulysses)) if size > 1}

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs)
    with warnings.catch_warnings(record=True):  # XLA's equal tiles keep the text refiner whole: printed below
        warnings.simplefilter("always", partitioner.PartitionWarning)
        partitioned = partitioner.partition(model, mesh, ((), inputs), programs="global")
    compiled = partitioned.compile(backend="xla")  # raises CollectiveMismatch if XLA's collectives differ
    actual = compiled(**inputs)

    print(f"tiny MiniMax-H3 on XLA SPMD, mesh {mesh}, float32")
    sharded, total = partitioned.report().attentions_sharded or (0, 0)
    for where, why in partitioned.ctx.sequence_whole.items():
        print(f"  attention {where} left whole ({sharded}/{total} sharded): {why}")
    video = float((actual.sample - expected.sample).abs().max())
    audio = float((actual.audio_sample - expected.audio_sample).abs().max())
    print(f"max |XLA - CPU model|: video {video:.2e}  audio {audio:.2e}")
    found = Counter((c.kind, axis_of(c.groups, partitioned.mesh)) for c in compiled.stats.collectives)
    print("collectives in XLA's partitioned HLO (all equal to the plan's):")
    for (kind, axis), count in sorted(found.items()):
        print(f"  {kind:<12} over {axis:<8} x{count}   groups {partitioned.mesh.groups(axis)}")
    if max(video, audio) > 1e-5:
        raise SystemExit("mismatch against the CPU model")


if __name__ == "__main__":
    main()
