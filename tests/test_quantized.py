"""Models quantised with torchao (as diffusers' ``TorchAoConfig`` loads them) partition like their float twins:
every rank's output against the quantised single-device model.

Tolerance. The models run in float32 with int8 or float8 weights dequantised in the graph, so the products are the
float ones of ``test_tp_numerics`` and the same bound holds: sharding only reorders the additions of K <= 96
float32 products of order 1 (~1e-5 worst case, ~4e-7 measured); ``atol = rtol = 1e-5``. The negative control (one
all_reduce removed) misses by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from partitioner.testing import cogvideox_inputs, drop_all_reduce, flux_inputs, run_ranks, tiny_cogvideox, tiny_flux

pytest.importorskip("torchao")  # an optional extra of the package; make test installs it

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
DROPPED_REDUCE = "transformer_blocks.0.attn.to_out.0"


def _config(kind: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig(), "float8": Float8WeightOnlyConfig()}[kind]


def _quantised(build, kind: str):
    from torchao.quantization import quantize_

    model = build()
    quantize_(model, _config(kind))
    return model


def _case(shape: tuple, names: tuple, model_name: str, kind: str, drop: str | None = None,
          backend: str = "eager") -> dict:
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    if model_name == "flux":
        model, inputs = _quantised(tiny_flux, kind), flux_inputs()
    else:
        model = _quantised(tiny_cogvideox, kind)
        inputs = cogvideox_inputs(model)
    with torch.no_grad():
        expected = model(**inputs).sample
    partitioned = partitioner.partition(model, init_device_mesh("cpu", shape, mesh_dim_names=names), ((), inputs))
    if drop:
        drop_all_reduce(partitioned, drop)
    report = partitioned.report()
    return dict(expected=expected, actual=partitioned.compile(backend=backend)(**inputs).sample,
                styles=dict(partitioned.linear_styles), parameter_bytes=sum(report.parameter_bytes.values()),
                whole_bytes=sum(p.numel() * p.element_size() for _, p in _parts(model)))


def _parts(model):
    from partitioner.tensor_parts import plain_parts

    return [part for name, tensor in model.state_dict().items() for part in plain_parts(tensor, name)]


def _float_styles(shape: tuple, names: tuple) -> dict:
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return dict(partitioner.partition(tiny_flux(), mesh, ((), flux_inputs())).linear_styles)


def _loaded_case(checkpoint: str) -> dict:
    """Shard-on-read: a partition of one quantised model loads another's quantised safetensors, as diffusers saves
    a model loaded with ``TorchAoConfig`` (torchao's names: ``proj_out._weight_qdata``, ``_weight_scale``)."""
    import partitioner
    from diffusers import FluxTransformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    inputs = flux_inputs()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    partitioned = partitioner.partition(_quantised(tiny_flux, "int8"), mesh, ((), inputs))
    partitioned.load_weights(checkpoint)
    with torch.no_grad():
        expected = FluxTransformer2DModel.from_pretrained(checkpoint, torch_dtype=torch.float32)(**inputs).sample
    return dict(expected=expected, actual=partitioned.compile()(**inputs).sample,
                qdata_shape=tuple(partitioned.state["proj_out.weight.qdata"].shape))


def _with_quantised_transformer(pipe, folder: str):
    """``pipe`` with its transformer loaded as diffusers loads one with ``quantization_config`` (``TorchAoConfig``)."""
    from diffusers import TorchAoConfig

    pipe.transformer.save_pretrained(folder)
    pipe.transformer = type(pipe.transformer).from_pretrained(
        folder, torch_dtype=torch.float32, quantization_config=TorchAoConfig(_config("int8")))
    return pipe


def _pipeline_case(folder: str) -> dict:
    """``parallelize`` on a pipeline whose transformer is quantised: every step's latents and the image."""
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.testing.pipelines import run, tiny_flux_pipeline

    reference = _with_quantised_transformer(tiny_flux_pipeline(), folder)
    pipe = partitioner.parallelize(_with_quantised_transformer(tiny_flux_pipeline(), folder),
                                   init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    (steps, image), (expected_steps, expected_image) = run(pipe, "flux"), run(reference, "flux")
    styles = pipe.transformer.partitioned.linear_styles
    return dict(actual=[*steps, image], expected=[*expected_steps, expected_image],
                split=sum(style != "replicate" for style in styles.values()))


def _two_ranks(rank: int, world: int, checkpoint: str) -> dict:
    tp, ulysses = ((2,), ("tp",)), ((2,), ("ulysses",))
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        pipeline = _pipeline_case(folder)
    return dict(pipeline=pipeline, loaded=_loaded_case(checkpoint), int8_tp=_case(*tp, "flux", "int8"),
                float8_tp=_case(*tp, "flux", "float8", backend="inductor"),
                float_tp_styles=_float_styles(*tp), dropped=_case(*tp, "flux", "int8", drop=DROPPED_REDUCE),
                int8_ulysses=_case(*ulysses, "flux", "int8"), video_float8_tp=_case(*tp, "cogvideox", "float8"))


def _four_ranks(rank: int, world: int) -> dict:
    both = ((2, 2), ("tp", "ulysses"))
    return dict(flux_float8=_case(*both, "flux", "float8"), video_int8=_case(*both, "cogvideox", "int8"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from diffusers import FluxTransformer2DModel, TorchAoConfig

    folder = tmp_path_factory.mktemp("quantised")
    tiny_flux(seed=3).save_pretrained(folder / "float")
    FluxTransformer2DModel.from_pretrained(folder / "float", torch_dtype=torch.float32,
                                           quantization_config=TorchAoConfig(_config("int8"))
                                           ).save_pretrained(folder / "int8")
    return run_ranks(2, _two_ranks, str(folder / "int8"))


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, _four_ranks)


@pytest.mark.parametrize("name", ["int8_tp", "float8_tp", "int8_ulysses", "video_float8_tp"])
def test_quantised_model_matches_its_single_device_self_on_two_ranks(two_ranks, name):
    for cases in two_ranks:
        torch.testing.assert_close(cases[name]["actual"], cases[name]["expected"], **TOLERANCE)


@pytest.mark.parametrize("name", ["flux_float8", "video_int8"])
def test_quantised_model_matches_at_tp2_by_ulysses2(four_ranks, name):
    for cases in four_ranks:
        torch.testing.assert_close(cases[name]["actual"], cases[name]["expected"], **TOLERANCE)


@pytest.mark.parametrize("name", ["int8_tp", "float8_tp"])
def test_quantised_linears_shard_like_their_float_twins(two_ranks, name):
    """The matmul torchao traces to is planned as the Linear it is: the same column/row/packed decisions as the
    float model, and each rank holds about half of the quantised bytes (payload and scales)."""
    for cases in two_ranks:
        case = cases[name]
        assert case["styles"] == cases["float_tp_styles"]
        assert sum(style != "replicate" for style in case["styles"].values()) >= 20
        assert case["parameter_bytes"] < 0.6 * case["whole_bytes"]


def test_quantised_safetensors_load_shard_on_read(two_ranks):
    """Each rank reads its rows of the payload and scales by the checkpoint's own names, and matches the model
    diffusers loads from the same file."""
    for cases in two_ranks:
        case = cases["loaded"]
        torch.testing.assert_close(case["actual"], case["expected"], **TOLERANCE)
        assert case["qdata_shape"] == (8, 32)  # proj_out: row-parallel, 64 input features over 2 ranks


def test_pipeline_with_a_quantised_transformer_through_parallelize(two_ranks):
    """A Flux pipeline whose transformer diffusers loaded with ``TorchAoConfig`` (int8 weight-only), through
    ``parallelize`` at TP=2: every step's latents and the image as the unpartitioned pipeline's, Linears split."""
    for cases in two_ranks:
        case = cases["pipeline"]
        assert len(case["actual"]) == 4  # 3 steps and the image
        for actual, expected in zip(case["actual"], case["expected"]):
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        assert case["split"] >= 10


def test_quantised_model_without_one_all_reduce_fails(two_ranks):
    """Negative control: one all_reduce removed after a quantised row-parallel Linear, every rank misses."""
    for cases in two_ranks:
        case = cases["dropped"]
        assert (case["actual"] - case["expected"]).abs().max() > 1e-3


def test_weights_digest_reads_quantised_payloads():
    """The digest the ranks compare read ``.numpy()`` of torchao's weights (a raw RuntimeError before tracing);
    it now reads their plain parts, so a rank whose quantised payload differs is still caught."""
    from partitioner.runtime.fingerprints import weights_digest

    model = _quantised(tiny_flux, "int8")
    before = weights_digest(model)
    with torch.no_grad():
        model.proj_out.weight.qdata[0, 0] += 1
    assert weights_digest(model) != before


def test_a_quantised_format_no_rule_splits_is_named_not_silent():
    """torchao's int8 dynamic-activation Linear is an ``_int_mm`` of quantised activations, not a product by a
    weight: its weights stay whole on every rank, with a PartitionWarning and explain() naming each."""
    import partitioner
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from partitioner.errors import PartitionWarning
    from partitioner.testing import fake_mesh

    model = tiny_flux()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    with fake_mesh((2,), ("tp",), 0) as mesh, pytest.warns(PartitionWarning, match=r"cannot split \d+ quantised"):
        partitioned = partitioner.partition(model, mesh, ((), flux_inputs()))
    assert "proj_out.weight: quantised, held whole on every rank: read by _int_mm" in partitioned.explain()
