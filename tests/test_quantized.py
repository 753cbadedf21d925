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
    verified = partitioned.verify(**inputs) if not drop else None  # the payload and scales whole, from the model
    return dict(expected=expected, actual=partitioned.compile(backend=backend)(**inputs).sample, verified=verified,
                trainable=partitioned.trainable,
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


def test_verify_reads_quantised_parts_and_nothing_is_marked_to_train(two_ranks):
    """verify() takes each part whole from the model's quantised weight (it looked for ``...weight.qdata`` among
    the model's parameters); torchao freezes the weights it quantises and leaves biases alone, which marked the
    model "to train" (every call then built the training copy)."""
    for cases in two_ranks:
        for name in ("int8_tp", "float8_tp", "int8_ulysses"):
            assert cases[name]["verified"] is not None and not cases[name]["trainable"]


class _TwoWeights(torch.nn.Module):
    """Two products by raw parameters of one module, as ``x @ self.w1`` is written."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(16, 64)), torch.nn.Parameter(torch.randn(64, 16))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def test_products_by_weights_of_one_module_keep_their_own_decisions():
    """``x @ self.w1`` then ``@ self.w2`` are two Linears of one module: each keeps its decision under its
    parameter's name (both were keyed ``blk``: the saved plan kept one, and replaying it built another program)."""
    import partitioner
    from partitioner.testing import fake_mesh

    model = torch.nn.Sequential()
    model.add_module("blk", _TwoWeights())
    example = ((torch.randn(2, 5, 16),), {})
    with fake_mesh((2,), ("tp",), 0) as mesh:
        partitioned = partitioner.partition(model, mesh, example)
        styles = {path: str(style) for path, style in partitioned.linear_styles.items()}
        replayed = partitioner.partition(model, mesh, example, plan=partitioner.Plan.of(partitioned))
    assert styles == {"blk.w1": "colwise", "blk.w2": "rowwise"}
    assert replayed.collective_counts() == partitioned.collective_counts()


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_tied_quantised_weights_and_another_shape():
    """A quantised weight tied to two Linears is named as the model names it under either name (export keeps one;
    it kept torch's ``b.parametrizations.weight.original0``), and a quantised model serves another input shape (its
    config rebuilt a float skeleton: the new trace's names did not match)."""
    import partitioner
    from torchao.quantization import quantize_
    from partitioner.testing import fake_mesh

    model = _Tied()
    quantize_(model, _config("int8"))
    model.b.weight = model.a.weight
    with fake_mesh((2,), ("tp",), 0) as mesh:
        partitioned = partitioner.partition(model, mesh, ((torch.randn(2, 3, 32),), {}))
    names = [gi.target for gi in partitioned.ctx.inputs if gi.is_model_tensor]
    assert not [name for name in names if "parametrizations" in name], names
    assert {gi.part_of for gi in partitioned.ctx.inputs if gi.part_of} <= {"a.weight", "b.weight"}

    flux = _quantised(tiny_flux, "float8")
    inputs = flux_inputs()
    with fake_mesh((2,), ("tp",), 0) as mesh:
        partitioned = partitioner.partition(flux, mesh, ((), inputs))
        other = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :5],
                     txt_ids=inputs["txt_ids"][:5])
        specialized = partitioned.specialize(((), other))
    assert specialized.linear_styles == partitioned.linear_styles


@pytest.mark.parametrize("name, kind", [("wan", "int8"), ("cogview4", "float8")])
def test_quantised_zoo_models_split_like_their_float_twins(name, kind):
    """Wan normalises q and k over all heads after a quantised projection's scale and bias (the norm stayed whole:
    the per-feature scale and a flatten/unflatten pair hid the Linear), and CogView4 traces a dequantised weight
    nothing reads (it kept its parts whole on every rank). Every split Linear's parts are cut at load."""
    import warnings

    import partitioner
    from torchao.quantization import quantize_
    from partitioner.testing import fake_mesh
    from partitioner.testing.zoo import build, inputs

    example = inputs(name)
    model = build(name)
    quantize_(model, _config(kind))
    with fake_mesh((2,), ("tp",), 0) as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float_styles = partitioner.partition(build(name), mesh, example).linear_styles
        partitioned = partitioner.partition(model, mesh, example)
    assert partitioned.linear_styles == float_styles
    split = {path for path, style in partitioned.linear_styles.items() if str(style) != "replicate"}
    whole = [gi.target for gi in partitioned.ctx.inputs
             if gi.part_of and gi.part_of.rsplit(".", 1)[0] in split and gi.target not in partitioned.slice_specs
             and gi.target.endswith(".qdata")]
    assert split and not whole, whole


class _Reordered(torch.nn.Module):
    """A weight built from a list of one parameter's pieces (``cat``): its Linear is still the module's."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(128, 64))
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(torch.nn.functional.linear(x, torch.cat([self.w[64:], self.w[:64]]))))


class _DataDependentRows(torch.nn.Module):
    """Rows picked by a data-dependent index, flattened and regrouped: views of views of unbacked sizes."""

    def __init__(self):
        super().__init__()
        self.table, self.lin = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Linear(3, 16)

    def forward(self, ids):
        rows = torch.nonzero(ids).flatten()
        torch._check(rows.shape[0] <= 12)
        return self.lin(self.table[rows].reshape(-1).reshape(-1, 3))


def test_plan_keys_follow_lists_of_weights_and_views_of_unbacked_sizes_trace():
    """A weight made by ``cat`` of a parameter's pieces keys its Linear by the module (a list argument was keyed by
    node names); a view of a view over data-dependent rows is left as it is (comparing its sizes guarded on them:
    the trace's clean-up raised)."""
    import partitioner

    reordered = partitioner.partition(_Reordered(), {"tp": 2}, ((torch.randn(2, 8, 64),), {}))
    assert set(reordered.linear_styles) == {"w", "down"}  # (a top-level parameter: its own name)
    model = _DataDependentRows()
    ids = torch.tensor([1, 0, 1, 1])
    with torch.no_grad():
        expected = model(ids)
    partitioned = partitioner.partition(model, {"tp": 2}, ((ids,), {}))
    assert "lin" in partitioned.linear_styles and expected.shape == (6, 16)  # 3 rows of 6, regrouped by 3
