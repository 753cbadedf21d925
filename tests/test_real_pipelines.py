"""Real diffusers pipelines end to end: ``pipe = partitioner.parallelize(pipe, mesh)`` then ``pipe(prompt=...)``.

FluxPipeline (CLIP + T5), StableDiffusion3Pipeline (two CLIPs + T5; guidance > 1 as a batch of 2),
StableDiffusionPipeline (a UNet denoiser: its convolutions' rows split as a VAE's under Ulysses, its attentions
sequence-sharded; CLIP; guidance as a batch of 2, at Ulysses=2 and cfg=2), WanPipeline (UMT5; guidance as two calls
per step, two experts: ``transformer`` then ``transformer_2``), QwenImagePipeline (Qwen2.5-VL; true CFG as two calls
per step) and MiniMax-H3's modular pipeline (its core denoising and decode blocks), each built in-process from tiny
random components with real tokenizers over a small vocabulary (``partitioner.testing.pipelines``), on gloo ranks at
TP=2, Ulysses=2 and TP=2 x Ulysses=2, and SD3 at cfg=2 and cfg=2 x TP=2. Every denoising step's latents and the
decoded output are compared with the unpartitioned pipeline's on every rank (1e-4 of their magnitude where it exceeds
1: float32 with sums reordered; measured at most 3e-6). Under Ulysses every attention of every program must be
sequence-sharded: an exact but replicated run is no parallelism. A second request at another resolution (or video
length) is served by one shape specialisation per denoiser, counted on ``pipe.transformer.specializations``. Every VAE
of every pipeline (H3: video and audio) is partitioned too, its decode split over every rank of the mesh (halo
exchanges or ring attention counted on each rank), and the decoded output is compared as above. Ranks seeded
differently are refused on every rank (input fingerprints); with the fingerprints off they must come out different
(the negative control). Two gloo pools serve every case.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from partitioner.testing import RankPool

TOLERANCE = 1e-4
MODES = {"tp2": ((2,), ("tp",)), "ulysses2": ((2,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses")),
         "cfg2": ((2,), ("cfg",)), "cfg2xtp2": ((2, 2), ("cfg", "tp"))}
CASES = [(name, mode) for name in ("flux", "sd3", "wan", "qwen_image", "h3")
         for mode in ("tp2", "ulysses2", "tp2xulysses2")] + [("sd3", "cfg2"), ("sd3", "cfg2xtp2"), ("sd", "ulysses2"),
                                                              ("sd", "cfg2")]
SECOND_REQUEST = "ulysses2"  # the mode in which each pipeline also serves a request at another size
TWO_EXPERTS = ("wan", "tp2")  # Wan 2.2's two experts (transformer, then transformer_2) in one mode, one elsewhere
OPTIONS = {"h3": dict(buckets={"timestep": 4})}  # H3's row timestep table: 1 to 4 rows per step, padding unread


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _build(name: str, experts: int = 1):
    from partitioner.testing.pipelines import BUILDERS

    return BUILDERS[name](**({"experts": experts} if name == "wan" else {}))


def _errors(got, expected) -> list[float]:
    """Max |difference| of every step's latents, then of the decoded output, over their magnitude where it exceeds
    1 (SD's DDIM latents at guidance 7.5 reach 44)."""
    (steps, output), (expected_steps, expected_output) = got, expected
    assert len(steps) == len(expected_steps) >= 2, (len(steps), len(expected_steps))
    return [(a - b).abs().max().item() / max(1.0, b.abs().max().item())
            for a, b in zip(steps + [output], expected_steps + [expected_output])]


def _denoisers(pipe) -> dict:
    from partitioner.runtime.pipelines import denoisers

    found = {}
    for name in denoisers(pipe):
        stand_in = getattr(pipe, name)
        attention = [(i, module, why) for i, partitioned in enumerate(stand_in.partitions)
                     for module, why in partitioned.ctx.sequence_attention.items()]
        collectives = stand_in.partitioned.collective_counts() if stand_in.is_partitioned else {}
        found[name] = dict(kind=type(stand_in).__name__, partitioned=stand_in.is_partitioned,
                           ulysses_exchanges=sum(n for (kind, axis), n in collectives.items() if axis == "ulysses"),
                           specializations=len(stand_in.specializations), attentions=len(attention),
                           unsharded=[f"program {i}: {module}: {why}" for i, module, why in attention
                                      if not why.sharded])
    return found


def _end_to_end(rank, world, name, shape, names, second_request, experts):
    import partitioner
    from partitioner.runtime.pipelines import autoencoders
    from partitioner.testing.pipelines import OTHER_SIZE, run

    reference = _build(name, experts)
    pipe = partitioner.parallelize(_build(name, experts), _mesh(shape, names), **OPTIONS.get(name, {}))
    result = dict(errors=_errors(run(pipe, name), run(reference, name)))
    if second_request:
        result["second"] = _errors(run(pipe, name, **OTHER_SIZE[name]), run(reference, name, **OTHER_SIZE[name]))
    result["denoisers"] = _denoisers(pipe)
    result["vaes"] = {}
    for name in autoencoders(pipe):
        decode = vars(getattr(pipe, name)).get("decode")
        counts = decode.partitioned.collective_counts() if decode.partitioned else {}
        result["vaes"][name] = dict(partitioned=decode.partitioned is not None, whole_because=decode.whole_because,
                                    split=sum(n for (kind, axis), n in counts.items()
                                              if kind in ("halo_exchange", "ring_pass")),
                                    idle=decode.partitioned.ctx.sequence_idle if decode.partitioned else None)
    return result


@pytest.mark.parametrize("name, mode", CASES, ids=[f"{name}-{mode}" for name, mode in CASES])
def test_pipeline_matches_the_unpartitioned_pipeline_on_every_rank(pools, name, mode):
    shape, names = MODES[mode]
    experts = 2 if (name, mode) == TWO_EXPERTS else 1
    results = pools[math.prod(shape)].run(_end_to_end, name, shape, names, mode == SECOND_REQUEST, experts)
    expected_denoisers = ["transformer", "transformer_2"] if experts == 2 else ["unet"] if name == "sd" else \
        ["transformer"]
    print(f"\n{name} {mode}: max |partitioned - unpartitioned| over steps and output, every rank "
          f"{max(max(r['errors'] + r.get('second', [])) for r in results):.1e}")
    for rank, result in enumerate(results):
        assert max(result["errors"]) <= TOLERANCE, (rank, result["errors"])
        assert list(result["denoisers"]) == expected_denoisers
        for component, found in result["denoisers"].items():
            assert found["kind"] == "LazyPartition" and found["partitioned"], (component, found)
            if "ulysses" in names:  # every attention of every program (the second request's too) sequence-sharded
                assert found["attentions"] > 0 and not found["unsharded"], (component, found["unsharded"])
                assert found["ulysses_exchanges"] > 0, (component, found)
            if mode == SECOND_REQUEST:
                assert found["specializations"] == 1, (component, found)
        if mode == SECOND_REQUEST:
            assert max(result["second"]) <= TOLERANCE, (rank, result["second"])
        # every rank of the mesh decodes its rows of the image (or frames; H3: also of the audio); at 4 ranks a
        # latent of fewer rows (H3's 2 x 2) cannot be split, which the partition says (its axis splits nothing)
        assert sorted(result["vaes"]) == (["audio_vae", "vae"] if name == "h3" else ["vae"]), result["vaes"]
        for component, found in result["vaes"].items():
            assert found["partitioned"], (component, found)
            assert found["split"] > 0 or (math.prod(shape) > 2 and found["idle"] == ["ring"]), (component, found)


def _flux_call_inputs(pipe):
    """The transformer's inputs as FluxPipeline builds them for CALLS["flux"] (48 image rows, 12 text rows)."""
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 48, 16, generator=g), torch.randn(1, 12, 32, generator=g), torch.randn(1, 32, generator=g),
            torch.tensor([0.5]), pipe._prepare_latent_image_ids(1, 6, 8, "cpu", torch.float32),
            torch.zeros(12, 3), torch.tensor([3.5]))


def _stand_in(rank, world, tmp):
    """What a pipeline and a user read from the transformer, before and after the first call, and what is refused
    after it; and the negative control."""
    import partitioner
    from partitioner.errors import AlreadyPartitioned
    from partitioner.testing.pipelines import run

    reference = _build("flux")
    pipe = partitioner.parallelize(_build("flux"), _mesh((world,), ("tp",)))
    model = reference.transformer

    def reads():
        stand_in = pipe.transformer
        with stand_in.cache_context("cond"):
            pass
        return dict(device=str(stand_in.device), dtype=stand_in.dtype, config=stand_in.config == model.config,
                    execution_device=str(pipe._execution_device), pipe_device=str(pipe.device), pipe_dtype=pipe.dtype,
                    index=tuple(pipe.config["transformer"]), guidance=stand_in.config.guidance_embeds,
                    processors=sorted(stand_in.attn_processors) == sorted(model.attn_processors),
                    signature=list(inspect.signature(stand_in.forward).parameters)
                    == list(inspect.signature(model.forward).parameters),
                    to=pipe.to("cpu") is pipe and stand_in.to("cpu") is stand_in,
                    hooks=not hasattr(stand_in, "_hf_hook") and not hasattr(stand_in, "_diffusers_hook"),
                    probe=hasattr(stand_in, "fuse_qkv_projections"), cache=stand_in.is_cache_enabled)

    before = reads()
    same = _errors(run(pipe, "flux"), run(reference, "flux"))
    after = reads()
    # ranks must run the pipeline on the same inputs: ranks seeded differently are refused on every rank (the
    # inputs' fingerprints), and the partition stays usable; negative control: with the fingerprints off they run
    # and come out different, so the comparisons above can fail
    from partitioner.errors import InputError

    try:
        run(pipe, "flux", seed=rank)
        seeded = None
    except InputError as error:
        seeded = str(error)
    checked = (pipe.transformer.partitioned, pipe.vae.decode.partitioned)  # the VAE refuses other latents too
    for partitioned in checked:
        partitioned.input_fingerprint = "off"
    different = _errors(run(pipe, "flux", seed=rank), run(reference, "flux", seed=rank))
    for partitioned in checked:
        partitioned.input_fingerprint = "sample"
    refused = {}
    attempts = {"fuse_qkv_projections": lambda t: t.fuse_qkv_projections(),
                "load_lora_adapter": lambda t: t.load_lora_adapter({}, adapter_name="x"),
                "set_attention_backend": lambda t: t.set_attention_backend("native"),
                "to(float16)": lambda t: t.to(torch.float16), "half": lambda t: t.half(),
                "pipe.to(bfloat16)": lambda t: pipe.to(torch.bfloat16), "state_dict": lambda t: t.state_dict(),
                "load_state_dict": lambda t: t.load_state_dict({}), "save_pretrained": lambda t: t.save_pretrained(tmp),
                "pipe.save_pretrained": lambda t: pipe.save_pretrained(tmp)}
    for what, attempt in attempts.items():
        try:
            attempt(pipe.transformer)
            refused[what] = None
        except AlreadyPartitioned as error:
            refused[what] = str(error)
    args = _flux_call_inputs(pipe)
    with torch.no_grad():
        expected = model(*args, return_dict=True).sample
    # positional arguments and return_dict; FluxPipeline passes joint_attention_kwargs={} (None is another trace)
    got = pipe.transformer(*args, joint_attention_kwargs={}, return_dict=True).sample
    got_tuple = pipe.transformer(*args[:3], timestep=args[3], img_ids=args[4], txt_ids=args[5], guidance=args[6],
                                 joint_attention_kwargs={}, return_dict=False)
    with pipe.transformer.partitioned.compile().cache_context("uncond"):  # compile()'s module too
        pass
    return dict(before=before, after=after, refused=refused, repr=repr(pipe.transformer), same=same,
                different=different, seeded=seeded,
                call=max((got - expected).abs().max().item(), (got_tuple[0] - expected).abs().max().item()),
                specializations=len(pipe.transformer.specializations))


def test_the_stand_in_answers_what_pipelines_read_and_refuses_changes_once_partitioned(pools, tmp_path):
    results = pools[2].run(_stand_in, str(tmp_path / "saved"))
    assert all(max(result["same"]) <= TOLERANCE for result in results)
    for result in results:  # other latents on rank 1: refused on every rank, naming the input
        assert result["seeded"] and "other input values" in result["seeded"] and "hidden_states" in \
            result["seeded"], result["seeded"]
    assert max(max(result["different"]) for result in results) > 1e-2  # the negative control is detected
    for rank, result in enumerate(results):
        expected = dict(device="cpu", dtype=torch.float32, config=True, execution_device="cpu", pipe_device="cpu",
                        pipe_dtype=torch.float32, index=("diffusers", "FluxTransformer2DModel"), guidance=True,
                        processors=True, signature=True, to=True, hooks=True, probe=True, cache=False)
        assert result["before"] == expected and result["after"] == expected, (rank, result)
        for what, message in result["refused"].items():
            assert message is not None, f"{what} was not refused"
            assert "parallelize" in message, message
        assert result["refused"]["fuse_qkv_projections"].startswith(
            "FluxPipeline.transformer.fuse_qkv_projections(): FluxTransformer2DModel is already partitioned")
        assert "transformer is partitioned" in result["refused"]["pipe.save_pretrained"]
        assert "partitioned over" in result["repr"]
        assert result["call"] <= TOLERANCE and result["specializations"] == 0


def test_before_the_first_call_the_model_is_whole_and_changes_apply_to_it(tmp_path):
    import json

    from diffusers import FluxPipeline

    import partitioner
    from partitioner.runtime.pipelines import LazyPartition

    pipe = partitioner.parallelize(_build("flux"), {"tp": 2})
    pipe.transformer.fuse_qkv_projections()  # the model's own method, on the whole model
    assert pipe.transformer.transformer_blocks[0].attn.fused_projections
    pipe.transformer.unfuse_qkv_projections()
    pipe.save_pretrained(tmp_path)  # the whole pipeline, its transformer as the model it stands for
    assert isinstance(pipe.transformer, LazyPartition)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    reloaded = FluxPipeline.from_pretrained(tmp_path)
    model = pipe.transformer.__dict__["_model"]
    assert all(torch.equal(a, b) for a, b in zip(reloaded.transformer.state_dict().values(),
                                                  model.state_dict().values()))


def test_a_transformer_on_meta_computes_on_the_mesh_device_and_needs_a_checkpoint(tmp_path):
    from diffusers import FluxTransformer2DModel

    import partitioner
    from partitioner.errors import InputError

    pipe = _build("flux")
    with torch.device("meta"):
        pipe.transformer = FluxTransformer2DModel.from_config(pipe.transformer.config)
    with pytest.raises(InputError, match=r"FluxPipeline.transformer \(FluxTransformer2DModel\) is on the meta device: "
                                         r"give parallelize\(..., checkpoint=path\)"):
        partitioner.parallelize(pipe, {"tp": 2})
    pipe = partitioner.parallelize(pipe, {"tp": 2}, checkpoint=str(tmp_path))
    assert pipe.transformer.device == torch.device("cpu") and pipe._execution_device == torch.device("cpu")
    with pytest.raises(partitioner.AlreadyPartitioned, match="on the meta device"):
        pipe.save_pretrained(tmp_path / "saved")


def test_parallelize_names_the_component_at_fault():
    from types import SimpleNamespace

    import partitioner
    from partitioner.errors import InputError

    pipe = _build("flux")
    with pytest.raises(InputError, match=r"FluxPipeline has no module 'unet' to parallelize \(it holds NoneType\); "
                                         r"its denoisers are \['transformer'\]"):
        partitioner.parallelize(pipe, {"tp": 2}, component="unet")
    partitioner.parallelize(pipe, {"tp": 2})
    with pytest.raises(InputError, match="FluxPipeline.transformer is already parallelized"):
        partitioner.parallelize(pipe, {"tp": 2})
    with pytest.raises(InputError, match=r"SimpleNamespace has no denoiser component .* its modules are \['vae'\]"):
        partitioner.parallelize(SimpleNamespace(vae=torch.nn.Linear(2, 2)), {"tp": 2})


def _flux_example(rank, world, folder):
    """examples/flux_pipeline.py's rank (its spawned and torchrun runs call the same function) with --model."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "flux_pipeline.py"
    spec = importlib.util.spec_from_file_location("flux_pipeline_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(tp=world, ulysses=1, steps=2, model=folder, prompt="a photo of a cat", height=12,
                              width=16, max_sequence_length=12, reference=True)
    return example.run_rank(rank, world, args)


def test_the_flux_example_reads_a_pipeline_folder_shard_by_shard(pools, tmp_path):
    """--model PATH: the transformer built on the meta device, each rank reading its slices of the checkpoint."""
    _build("flux").save_pretrained(tmp_path)
    for result in pools[2].run(_flux_example, str(tmp_path)):
        assert result["latents"] <= TOLERANCE and result["image"] <= TOLERANCE, result
        assert len(result["seconds"]) == 2


def _progress_bar(rank, world):
    from tqdm import tqdm

    for _ in tqdm(range(2), disable=True):  # tqdm makes a multiprocessing lock (a semaphore) in this rank
        pass
    return rank


def test_spawned_ranks_leave_no_leaked_semaphores():
    """A rank ends with os._exit (after its result is saved); multiprocessing's exit handlers run first, so the
    semaphores it made (tqdm's lock) are unlinked, not reported as leaked when the launcher exits."""
    import subprocess
    import sys

    code = ("from partitioner.testing import run_ranks\n"
            "from test_real_pipelines import _progress_bar\n"
            "if __name__ == '__main__':\n"
            "    print(run_ranks(2, _progress_bar))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=str(__import__("pathlib").Path(__file__).parent))
    assert result.returncode == 0 and "[0, 1]" in result.stdout, result.stderr[-3000:]
    assert "leaked semaphore" not in result.stderr, result.stderr


def test_tiny_qwen_image_pipeline_embeds_prompt_and_negative_prompt_apart():
    """The pipeline strips its chat template's system prefix by a token count (the real tokenizer's 34); the test
    tokenizer spells it byte by byte, so the tiny pipeline strips its own count. Left at 34, most rows of every
    embedding were the rest of the system prompt, alike for a prompt and its negative prompt, and no test of
    guidance could fail: here every row of the two embeddings differs (a causal encoder: each row after the prefix
    reads the prompt's first token)."""
    from partitioner.testing.pipelines import tiny_qwen_image_pipeline

    pipe = tiny_qwen_image_pipeline()
    with torch.no_grad():
        prompt, _ = pipe.encode_prompt("a red fox", device="cpu")
        negative, _ = pipe.encode_prompt("blurry", device="cpu")
    rows = min(prompt.shape[1], negative.shape[1])
    assert rows >= 9, prompt.shape  # the prompt's bytes and the template's closing tokens, not the system prompt
    assert (prompt[:, :rows] - negative[:, :rows]).abs().amax(-1).min() > 0
