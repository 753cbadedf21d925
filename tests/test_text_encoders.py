"""Text encoders as diffusers pipelines carry them (``transformers`` models: ``partitioner.testing.encoders``),
partitioned with no per-model code and exact on every rank against the unpartitioned encoder, one per defect that
kept them from starting (tolerance 1e-5 of the output's magnitude, float32 sums reordered, as test_zoo):

- every ``transformers`` forward ends in ``**kwargs``: a call that names its arguments traces (T5, Flux's and SD3's);
- a decoder returns its key/value cache unless asked not to: the cache is returned, exact (Llama, HunyuanVideo's);
- Gemma's RMSNorm casts back with ``output.type_as(x)`` where x is a partial sum under TP: ``type_as`` reads only
  x's dtype, so it takes x as its other readers have it reduced (it used to require the partial sum back: "cannot
  redistribute ... from R to P(sum)");
- transformers' cache starts each layer as ``torch.tensor([])`` concatenated onto the keys (Qwen3, Z-Image's);
- Gemma 2 writes its attention out (``softmax(tanh(q @ k^T * s / c) * c + mask) @ v``, no SDPA: a soft cap): it is
  recognised as attention (``rules/written_attention.py``) and its rows split, under Ulysses on head shards, under
  a ring on each rank's query rows (it used to split nothing: "ulysses=2 splits no value of this model").
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from partitioner.errors import TraceError
from partitioner.frontend.trace import bind_forward
from partitioner.testing import RankPool
from partitioner.testing.encoders import partition_case


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


CASES = [("t5", (2,), ("tp",)), ("llama", (2,), ("ulysses",)), ("gemma2", (2,), ("tp",)),
         ("qwen3", (2, 2), ("tp", "ulysses")), ("gemma2", (2,), ("ulysses",)), ("gemma2", (2,), ("ring",))]


@pytest.mark.parametrize("name,shape,names", CASES, ids=[f"{c[0]}-{'x'.join(c[2])}" for c in CASES])
def test_text_encoder_is_exact_on_every_rank(pools, name, shape, names):
    results = pools[math.prod(shape)].run(partition_case, name, shape, names)
    for rank, result in enumerate(results):
        assert result["status"] == "exact", (rank, result)
    first = results[0]
    if "tp" in names:
        assert first["collectives"].get("all_reduce:tp", 0) > 0, first
    if {"ulysses", "ring"} & set(names):  # every self-attention's rows split (Gemma 2's written out by hand)
        assert first["attention_sharded"] == first["attentions"] == 2, first
    if "ulysses" in names:  # on a head shard: q, k^T, v and the output exchanged
        assert first["collectives"].get("all_to_all:ulysses") == 8, first
    if name in ("llama", "qwen3"):  # hidden states of every layer and the key/value cache of both layers
        assert "DynamicCache" in first["output_types"] and first["tensors"] > 4, first


def test_a_kwargs_forward_binds_named_arguments_and_refuses_positional_extras():
    def forward(input_ids, attention_mask=None, *args, **kwargs):
        del input_ids, attention_mask, args, kwargs
    signature = inspect.signature(forward)
    ids = torch.ones(1, 3, dtype=torch.long)
    named = bind_forward(signature, (ids,), {"output_hidden_states": True}, "Encoder")
    assert list(named) == ["input_ids", "attention_mask", "output_hidden_states"]
    with pytest.raises(TraceError, match=r"Encoder.forward takes \*args and the call passes 1 value"):
        bind_forward(signature, (ids, None, 3), {}, "Encoder")


def _pipeline_with_text_encoders(rank, world, name):
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh
    from partitioner.runtime.pipelines import text_encoders
    from partitioner.testing.pipelines import run, tiny_flux_pipeline, tiny_qwen_image_pipeline

    build = dict(flux=tiny_flux_pipeline, qwen_image=tiny_qwen_image_pipeline)[name]
    reference = build()
    pipe = partitioner.parallelize(build(), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                                   text_encoder=True, vae=False)
    (steps, output), (expected_steps, expected) = run(pipe, name), run(reference, name)
    errors = [(a - b).abs().max().item() for a, b in zip(steps + [output], expected_steps + [expected])]
    encoders = {component: getattr(pipe, component).partitioned for component in text_encoders(pipe)}
    return errors, {component: dict(p.collective_counts()) for component, p in encoders.items()}, \
        {component: p.linear_styles for component, p in encoders.items()}


@pytest.mark.parametrize("name", ["flux", "qwen_image"])
def test_parallelize_partitions_the_pipelines_text_encoders(pools, name):
    """The text encoders inside ``parallelize(pipe, mesh, text_encoder=True)`` (Flux's CLIP and T5, Qwen-Image's
    Qwen2.5-VL): each a partition of its own (all_reduces over tp), the pipeline's steps and image as the
    unpartitioned pipeline's. Qwen2.5-VL returns its key/value cache unless called with ``use_cache=False``, which
    the pipeline does not pass and never reads: it is called without one, so its key and value projections split
    by columns like the queries (returning the cache kept them whole on every rank)."""
    for rank, (errors, collectives, styles) in enumerate(pools[2].run(_pipeline_with_text_encoders, name)):
        assert max(errors) <= 1e-4, (rank, errors)
        assert collectives and all(counts.get(("all_reduce", "tp"), 0) > 0 for counts in collectives.values())
        keys = {path: style for component in styles.values() for path, style in component.items()
                if path.endswith(("k_proj", "v_proj"))}
        assert all(style == "colwise" for style in keys.values()), keys
