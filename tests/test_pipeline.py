"""The compiled partition as a drop-in transformer: diffusers' own H3 denoising block drives it step after step.

The row timestep plan of each step comes from diffusers' `build_row_timesteps` (1 to 4 distinct timesteps), so the
`timestep` input changes size between steps; the partition is made once, from step 0's inputs, with the timestep
table bucketed ([2, 4] rows: padding proven unread), and serves the other sizes from the traced program (1 or 2
rows) and one shape specialisation (3 or 4 rows). Tolerance as in test_tp_numerics: float32, reordered sums, 1e-5.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from partitioner import partition
from partitioner.testing import TINY_H3, h3_inputs, run_ranks, tiny_h3

TOLERANCE = 1e-5
# (video, audio, video conditioning, audio reference) timesteps: 1, 2, 3 and 4 distinct values
STEPS = [(0.9, 0.9, 0.9, 0.9), (0.8, 0.8, 0.0, 0.0), (0.7, 0.6, 0.0, 0.0), (0.5, 0.4, 0.1, 0.0)]
LAYOUT = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _denoise_steps(rank, world, shape, names):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    plan = [MiniMaxH3SetTimestepsStep.build_row_timesteps(inputs["video_indices"], inputs["audio_indices"], 4, 2,
                                                          inputs["text_indices"].numel(), *step) for step in STEPS]
    layout = {name: inputs[name] for name in LAYOUT}
    step0 = dict(inputs, timestep=plan[0][0], timestep_indices=plan[0][1])
    transformer = partition(model, _mesh(shape, names), ((), step0), buckets={"timestep": [2, 4]}).compile()
    denoiser = MiniMaxH3LoopDenoiser()

    def state():
        return BlockState(latents=inputs["hidden_states"][0], audio_latents=inputs["audio_hidden_states"][0],
                          prompt_embeds=inputs["encoder_hidden_states"], row_timestep_plan=plan,
                          denoiser_input_fields=layout, attention_kwargs=None)

    errors = []
    for i in range(len(STEPS)):
        _, got = denoiser(SimpleNamespace(transformer=transformer), state(), i, None)
        _, expected = denoiser(SimpleNamespace(transformer=model), state(), i, None)
        errors.append(max((got.noise_pred - expected.noise_pred).abs().max().item(),
                          (got.audio_noise_pred - expected.audio_noise_pred).abs().max().item()))
    # a second request at another resolution and text length
    other = h3_inputs(TINY_H3, text=7, video=10, audio=4, timesteps=3, seed=5)
    with torch.no_grad():
        expected = model(**other, return_dict=False)
    got = transformer(**other, return_dict=False)
    errors.append(max((a - e).abs().max().item() for a, e in zip(got, expected)))
    return errors, transformer.specializations, str(transformer.partitioned.report())


@pytest.mark.parametrize("shape, names", [((2,), ("tp",)), ((2, 2), ("tp", "ulysses"))], ids=["tp2", "tp2xulysses2"])
def test_diffusers_denoiser_drives_the_partition_over_steps_and_requests(shape, names):
    for errors, specializations, report in run_ranks(2 if len(shape) == 1 else 4, _denoise_steps, shape, names):
        assert max(errors) <= TOLERANCE, errors
        assert len(specializations) == 2, specializations  # the 4-row bucket; the second request
        assert any("timestep[4]" in shapes and "encoder_hidden_states[1, 7, 32]" in shapes
                   for shapes in specializations)
        assert "shape specialisations built: 2" in report


def _bucketed_timesteps(rank, world):
    """One partition traced with a 2-row timestep table serves 1 and 2 rows by padding; an index into the padding,
    a table beyond every bucket, and an unbucketed change of length are InputErrors on every rank."""
    from partitioner.errors import InputError

    model = tiny_h3()
    transformer = partition(model, _mesh((world,), ("tp",)), ((), h3_inputs(TINY_H3, timesteps=1)),
                            buckets={"timestep": 2}).compile()
    errors, refusals = [], []
    for timesteps in (1, 2, 1):
        inputs = h3_inputs(TINY_H3, timesteps=timesteps, seed=timesteps)
        with torch.no_grad():
            expected = model(**inputs).sample
        errors.append((transformer(**inputs).sample - expected).abs().max().item())
    one_row = h3_inputs(TINY_H3, timesteps=1)
    for bad in (dict(one_row, timestep_indices=torch.ones_like(one_row["timestep_indices"])),  # row 1 is padding
                dict(one_row, timestep=torch.rand(3))):  # beyond the only bucket
        try:
            transformer(**bad)
        except InputError as error:
            refusals.append(str(error))
    return errors, refusals, transformer.specializations, transformer.partitioned.ctx.padding_reads


def test_a_bucketed_timestep_table_is_padded_exactly_and_padding_is_never_read():
    for errors, refusals, specializations, padding_reads in run_ranks(2, _bucketed_timesteps):
        assert max(errors) <= TOLERANCE and not specializations
        assert padding_reads and all(read[1:] == (0, 2) for read in padding_reads.values())
        assert len(refusals) == 2, refusals
        assert "valid indices are in [0, 3) (the rest is padding to a bucket)" in refusals[0]  # 3 rows per step
        assert "timestep has 3 entries along dim 0, more than every bucket it is served at ([2])" in refusals[1]


class _PaddedAttention(torch.nn.Module):
    def forward(self, x, table, rows):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x), table[rows]


def test_buckets_on_a_dim_whose_padding_would_be_read_are_refused():
    from partitioner.errors import PartitionError

    x, table, rows = torch.randn(1, 2, 8, 4), torch.randn(3), torch.zeros(8, dtype=torch.long)
    partition(_PaddedAttention(), {"tp": 1}, ((x, table, rows), {}), buckets={"table": 4})  # indexed rows: fine
    with pytest.raises(PartitionError, match=r"x is padded along dim 2 to its bucket \(\[16\]\).*attention"):
        partition(_PaddedAttention(), {"tp": 1}, ((x, table, rows), {}), buckets={("x", 2): 16})


def _parallelized(rank, world):
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    import partitioner

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    pipe = partitioner.parallelize(SimpleNamespace(transformer=tiny_h3()), _mesh((world,), ("tp",)))
    state = dict(latents=inputs["hidden_states"][0], audio_latents=inputs["audio_hidden_states"][0],
                 prompt_embeds=inputs["encoder_hidden_states"], attention_kwargs=None,
                 row_timestep_plan=[(inputs["timestep"], inputs["timestep_indices"])],
                 denoiser_input_fields={name: inputs[name] for name in LAYOUT})
    _, got = MiniMaxH3LoopDenoiser()(pipe, BlockState(**state), 0, None)
    _, expected = MiniMaxH3LoopDenoiser()(SimpleNamespace(transformer=model), BlockState(**state), 0, None)
    return (got.noise_pred - expected.noise_pred).abs().max().item(), type(pipe.transformer).__name__


def test_parallelize_swaps_the_pipelines_transformer():
    for error, kind in run_ranks(2, _parallelized):
        assert kind == "LazyPartition" and error <= TOLERANCE


def _drop_in(rank, world):
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    module = partition(model, _mesh((world,), ("tp",)), ((), inputs)).compile()
    parameters = list(inspect.signature(module.forward).parameters)
    return (isinstance(module, torch.nn.Module), parameters == list(inspect.signature(model.forward).parameters),
            module.config == model.config, module.dtype, str(module.device))


def test_drop_in_module_has_the_models_signature_config_dtype_and_device():
    for is_module, same_signature, same_config, dtype, device in run_ranks(2, _drop_in):
        assert is_module and same_signature and same_config
        assert dtype == torch.float32 and device == "cpu"


def _meta_model_real_inputs(rank, world, checkpoint):
    from diffusers import MiniMaxH3Transformer3DModel

    inputs = h3_inputs(TINY_H3)
    with torch.device("meta"):
        skeleton = MiniMaxH3Transformer3DModel(**TINY_H3).eval()
    partitioned = partition(skeleton, _mesh((world,), ("tp",)), ((), inputs))  # real inputs, meta model
    module = partitioned.load_weights(checkpoint).compile()
    with torch.no_grad():
        expected = tiny_h3()(**inputs).sample
    return (module(**inputs).sample - expected).abs().max().item()


def test_meta_model_partitioned_with_real_inputs_then_loaded_is_exact(tmp_path):
    tiny_h3().save_pretrained(tmp_path, max_shard_size="60KB")  # several safetensors files and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert max(run_ranks(2, _meta_model_real_inputs, str(tmp_path))) <= TOLERANCE


def test_the_pipeline_example_runs_under_torchrun():
    """Examples run under torchrun (one process per rank, the group from the environment) as by their own spawn."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "examples/h3_pipeline.py",
                             "--tp", "2", "--ulysses", "1", "--steps", "3"], cwd=root, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all(float(line.rsplit(" ", 1)[1]) <= 1e-4 for line in lines), result.stdout
