"""What a new user meets first: the command line on any diffusers model (plan, dump, verify), messages that name the
nearest valid name, and progress bars that show on a terminal only. The installed wheel itself is checked by
``make test-wheel`` (tests/wheel/smoke.sh), outside the checkout."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import partitioner
from partitioner.cli import main
from partitioner.errors import InputError, MeshError, PartitionError, PartitionWarning
from partitioner.plans import Plan
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

# Flux cut to one block of each kind: the production width (3072, 24 heads x 128) at the pipeline's 1024x1024
TWO_BLOCK_FLUX = ["--model", "FluxTransformer2DModel", "--config", "num_layers=1", "--config", "num_single_layers=1"]
TINY_FLUX = ["--config", "num_attention_heads=4", "--config", "attention_head_dim=16", "--config",
             "joint_attention_dim=32", "--config", "pooled_projection_dim=32", "--config", "in_channels=16",
             "--config", "axes_dims_rope=[4, 6, 6]", "--size", "text=7,height=8,width=8", "--dtype", "float32"]


@pytest.fixture
def run_cli(capsys):
    """``python -m partitioner ARGS`` in this process (``cli.main``: its exit code, what it printed); a
    PartitionWarning is an error."""
    def run(*args: str) -> subprocess.CompletedProcess:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PartitionWarning)
            code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def test_plan_of_a_diffusers_model_named_by_class_at_its_pipeline_sizes(run_cli, tmp_path):
    """No H3 and no Python: a class name, config keys over its defaults, the pipeline's 1024x1024 inputs on meta;
    the rank program's plan, memory and collectives, every attention sequence-sharded; --json is a Plan."""
    result = run_cli("plan", *TWO_BLOCK_FLUX, "--mesh", "tp=2,ulysses=2")
    assert result.returncode == 0, result.stderr
    assert "attentions sequence-sharded 2/2" in result.stdout and "all_to_all" in result.stdout
    assert "transformer_blocks.0.attn.to_q" in result.stdout
    result = run_cli("plan", *TWO_BLOCK_FLUX, "--mesh", "tp=2,ulysses=2", "--json", "--preset", "1024x768")
    plan = Plan.from_json(result.stdout)
    assert plan.mesh == {"tp": 2, "ulysses": 2} and set(plan.attention.values()) == {
        "sequence-sharded (Ulysses all_to_all)"}
    config = tmp_path / "config.json"  # a config file (as from_pretrained folders hold) names its class itself
    config.write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "num_layers": 1, "num_single_layers": 1}))
    result = run_cli("plan", "--config", str(config), "--mesh", "tp=2", "--size", "text=77")
    assert result.returncode == 0 and "colwise" in result.stdout, result.stderr


@pytest.mark.slow
def test_dumps_of_two_runs_are_equal_and_each_rank_has_its_folder(run_cli, tmp_path):
    args = ["dump", *TWO_BLOCK_FLUX, "--mesh", "tp=3", "--size", "text=7,height=8,width=8", "--dtype", "float32"]
    for run in ("a", "b"):
        result = run_cli(*args, "--out", str(tmp_path / run))
        assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "a")) == ["rank0", "rank1", "rank2"]
    comparison = filecmp.dircmp(tmp_path / "a", tmp_path / "b")
    assert _differing(comparison) == []
    index = (tmp_path / "a" / "rank0" / "index.txt").read_text().splitlines()
    assert index[0].startswith("00_export:") and index[-1].startswith("16_schedule_collectives:")
    assert (tmp_path / "a" / "rank0" / "16_schedule_collectives.py").read_text() != \
        (tmp_path / "a" / "rank2" / "16_schedule_collectives.py").read_text()  # 24 heads of 128 over 3: the same


def _differing(comparison: filecmp.dircmp) -> list[str]:
    found = comparison.diff_files + comparison.left_only + comparison.right_only
    for sub in comparison.subdirs.values():
        found += _differing(sub)
    return found


@pytest.mark.parametrize("args,message", [
    (["plan", "--model", "FluxTransformr2DModel", "--mesh", "tp=2"], "did you mean 'FluxTransformer2DModel'"),
    (["plan", "--model", "FluxTransformer2DModel", "--mesh", "tp=2,ulyses=2"], "did you mean 'ulysses'"),
    (["plan", "--model", "FluxTransformer2DModel", "--config", "num_layer=1", "--mesh", "tp=2"],
     "did you mean 'num_layers'"),
    (["plan", "--model", "FluxTransformer2DModel", "--preset", "1024x760", "--mesh", "tp=2"],
     "did you mean '1024x768'"),
    (["plan", "--model", "FluxTransformer2DModel", "--size", "txt=7", "--mesh", "tp=2"], "did you mean 'text'"),
    (["plan", "--model", "UNet2DConditionModel", "--mesh", "tp=2"], "no input builder is known"),
    (["plan", "--mesh", "tp=2"], "name the model"),
    (["verify", "--model", "FluxTransformer2DModel", "--mesh", "tp=2"], "torchrun --nproc-per-node 2"),
])
def test_a_misspelt_name_gets_the_nearest_valid_one_and_exit_code_2(run_cli, args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_misspelt_names_in_the_python_api_get_the_nearest_valid_one():
    model, example = tiny_h3(), ((), h3_inputs(TINY_H3))
    with pytest.raises(MeshError, match="did you mean 'ulysses'"):
        partitioner.plan(model, {"tp": 2, "ulyses": 2}, example)
    with pytest.raises(InputError, match="no public method 'fowrard' to trace \\(did you mean 'forward'"):
        partitioner.plan(model, {"tp": 2}, example, method="fowrard")
    partitioned = partitioner.partition(model, {"tp": 2}, example)
    with pytest.raises(KeyError, match="did you mean 'transformer_blocks.0.attn.to_q'"):
        partitioned.explain("transformer_blocks.0.attn.to_qq")
    with pytest.raises(KeyError, match="did you mean 'inductor'"):
        partitioned.compile(backend="indcutor")
    with pytest.raises(PartitionError, match=r"matches no Linear module \(did you mean 'transformer_blocks.0.attn.to_q'"):
        partitioner.plan(model, {"tp": 2}, example, plan={"transformer_blocks.0.attn.to_qq": "colwise"})
    with pytest.raises(PartitionError, match="did you mean 'rowwise'"):
        partitioner.plan(model, {"tp": 2}, example, plan={"transformer_blocks.0.attn.to_q": "rowise"})


@pytest.mark.slow
def test_verify_from_the_command_line_under_torchrun():
    """Every rank builds the same random weights, partitions on a DeviceMesh and checks every value it computes."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    result = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "partitioner", "verify", "--model",
                             "FluxTransformer2DModel", "--config", "num_layers=1", "--config", "num_single_layers=1",
                             *TINY_FLUX, "--mesh", "tp=2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every rank's" in result.stdout and "match the unpartitioned model" in result.stdout


def test_progress_bars_show_on_request_and_stay_silent_otherwise(capsys, monkeypatch):
    """Tracing and the passes show a tqdm bar where stderr is a terminal (PARTITIONER_PROGRESS=1 stands for one);
    here stderr is not one: silent. Rank 1 of a job never shows one."""
    import torch.distributed as dist

    model, example = tiny_h3(), ((), h3_inputs(TINY_H3))
    monkeypatch.delenv("PARTITIONER_PROGRESS", raising=False)
    partitioner.partition(model, {"tp": 2}, example)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PARTITIONER_PROGRESS", "1")
    partitioner.partition(model, {"tp": 2}, example)
    shown = capsys.readouterr().err
    assert "tracing MiniMaxH3Transformer3DModel (torch.export)" in shown and "partitioning" in shown
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    partitioner.partition(model, {"tp": 2}, example)
    assert capsys.readouterr().err == ""


def _plan_on_a_real_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ulysses"))
    return partitioner.Plan.of(partitioner.partition(tiny_h3(), mesh, ((), h3_inputs(TINY_H3)))).fingerprint


@pytest.mark.slow
def test_axis_sizes_plan_what_the_ranks_of_a_real_mesh_run():
    """The README's first lines plan on axis sizes; the ranks of a DeviceMesh of those sizes run the same plan."""
    from partitioner.testing import run_ranks

    sized = partitioner.plan(tiny_h3(), {"tp": 2, "ulysses": 2}, ((), h3_inputs(TINY_H3)))
    assert set(run_ranks(4, _plan_on_a_real_mesh)) == {sized.fingerprint}
    assert set(sized.attention.values()) == {"sequence-sharded (Ulysses all_to_all)"}
