"""Meta-device partitions loading their shards from safetensors: numerics, memory, and broken checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import partitioner
from partitioner import CheckpointError
from partitioner.planning.planner import apply_dtype
from partitioner.testing import TINY_H3, h3_inputs, run_ranks, tiny_h3


def mixed_precision_h3():
    """Tiny H3 as the real checkpoint is: bfloat16, with the `_keep_in_fp32_modules` in float32."""
    return apply_dtype(tiny_h3(), torch.bfloat16)


def meta_h3():
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        return apply_dtype(MiniMaxH3Transformer3DModel(**TINY_H3).eval(), torch.bfloat16)


def meta_inputs(inputs: dict) -> dict:
    return {name: value.to("meta") for name, value in inputs.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("h3")
    model = mixed_precision_h3()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    assert (root / "sharded" / "diffusion_pytorch_model.safetensors.index.json").exists()
    return root


def _load_and_run(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    inputs = h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = partitioner.partition(mixed_precision_h3(), mesh, ((), inputs)).compile()(**inputs)
    outputs = {}
    for layout in ("single", "sharded"):
        partitioned = partitioner.partition(meta_h3(), mesh, ((), meta_inputs(inputs)))
        partitioned.load_weights(f"{root}/{layout}")
        dtypes = {partitioned.state[n].dtype for n in ("proj_in.weight", "transformer_blocks.0.attn.to_q.weight")}
        outputs[layout] = (partitioned.compile()(**inputs), dtypes)
    return dict(expected=expected, outputs=outputs)


def test_loaded_partition_equals_in_memory_partition(checkpoints):
    """TP=2 on gloo: a meta partition loading single-file and sharded checkpoints computes exactly what the
    in-memory partition computes, with the checkpoint's mixed dtypes kept."""
    for result in run_ranks(2, _load_and_run, str(checkpoints)):
        for layout, (actual, dtypes) in result["outputs"].items():
            assert dtypes == {torch.float32, torch.bfloat16}, layout
            assert torch.equal(actual.sample, result["expected"].sample), layout
            assert torch.equal(actual.audio_sample, result["expected"].audio_sample), layout


def test_planner_bytes_equal_loaded_bytes(checkpoints):
    """The planner's per-rank parameter bytes are the bytes each rank holds after loading."""
    from partitioner.planning.planner import estimate
    from partitioner.frontend.trace import trace

    inputs = meta_inputs(h3_inputs(TINY_H3))
    traced = trace(meta_h3(), ((), inputs))
    for rank in range(2):
        planned = estimate(traced, "h3", tp=2, ulysses=1)
        partitioned = partitioner.partition(meta_h3(), {"tp": 2}, ((), inputs), rank=rank)
        partitioned.load_weights(checkpoints / "sharded")
        held = {}
        for gi in partitioned.ctx.inputs:
            if gi.kind == "parameter":
                tensor = partitioned.state[gi.target]
                key = str(tensor.dtype).removeprefix("torch.")
                held[key] = held.get(key, 0) + tensor.numel() * tensor.element_size()
        assert planned.parameter_bytes == held


@pytest.fixture()
def partitioned():
    return partitioner.partition(meta_h3(), {"tp": 2}, ((), meta_inputs(h3_inputs(TINY_H3))))


def _state(checkpoints) -> dict:
    return load_file(checkpoints / "single" / "diffusion_pytorch_model.safetensors")


def test_missing_tensor(partitioned, checkpoints, tmp_path):
    state = _state(checkpoints)
    del state["transformer_blocks.1.ff.net.2.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1: \['transformer_blocks\.1\.ff\.net\.2\.weight'\]"):
        partitioned.load_weights(tmp_path / "model.safetensors")
    assert partitioned.state["proj_in.weight"].is_meta  # nothing half-loaded


def test_unexpected_and_misshaped_and_mistyped(partitioned, checkpoints, tmp_path):
    state = _state(checkpoints)
    state["extra.weight"] = torch.zeros(2)
    state["proj_out.weight"] = torch.zeros(3, 3)
    state["norm_out.linear.bias"] = state["norm_out.linear.bias"].float()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        partitioned.load_weights(tmp_path / "model.safetensors")
    message = str(error.value)
    assert "unexpected 1: ['extra.weight']" in message
    assert "proj_out.weight: shape [3, 3]" in message and "the model has [16, 48]" in message
    assert "norm_out.linear.bias: F32" in message and "torch.bfloat16" in message


def test_corrupt_and_truncated_files(partitioned, checkpoints, tmp_path):
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt.safetensors: not a readable safetensors file"):
        partitioned.load_weights(tmp_path / "corrupt.safetensors")
    data = (checkpoints / "single" / "diffusion_pytorch_model.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.safetensors"):
        partitioned.load_weights(tmp_path / "truncated.safetensors")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        partitioned.load_weights(tmp_path / "absent.safetensors")
    (tmp_path / "bad.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="needs a 'weight_map'"):
        partitioned.load_weights(tmp_path / "bad.index.json")


MEMORY_SCRIPT = textwrap.dedent('''
    import sys, threading, time
    import torch, partitioner
    from safetensors.torch import save_file

    class Stack(torch.nn.Module):  # 8 x 8 MiB of float32 weights, in column/row pairs
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2048 if i % 2 else 1024, 1024 if i % 2 else 2048,
                                                              bias=False) for i in range(8))
        def forward(self, x):
            for i in range(0, 8, 2):
                x = x + self.layers[i + 1](torch.nn.functional.gelu(self.layers[i](x)))
            return x

    path = sys.argv[1]
    full = Stack()
    size = sum(p.numel() * 4 for p in full.parameters())
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, path)
    del full
    with torch.device("meta"):
        model = Stack()
    partitioned = partitioner.partition(model, {"tp": 4}, ((torch.empty(4, 1024, device="meta"),), {}))

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    base, peak, done = anon(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon() - base)
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    partitioned.load_weights(path)
    done.set(); sampler.join()
    peak[0] = max(peak[0], anon() - base)
    shard = sum(t.numel() * t.element_size() for t in partitioned.state.values())
    print(size, shard, peak[0])
''')


def test_loading_peak_memory_is_about_one_shard(tmp_path):
    """Reading 64 MiB of weights as rank 0 of TP=4 raises the process's own (anonymous) memory by the 16 MiB
    shard, not the checkpoint: slices are copied straight out of the memory-mapped file, row shards and column
    shards alike. (Pages of the file that are read stay page cache, reclaimable, not memory the rank holds.)"""
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "stack.safetensors")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    size, shard, peak = map(int, result.stdout.split())
    assert shard == size // 4
    assert shard * 0.9 < peak < shard * 1.5, f"peak {peak / 2**20:.1f} MiB for a {shard / 2**20:.1f} MiB shard"
