"""The model zoo: 26 diffusers transformers (tiny, random: ``partitioner.testing.zoo``), each partitioned with no
per-model code in TP=2, Ulysses=2 and TP=2 x Ulysses=2, exact on every rank against the unpartitioned model or
refused with a documented reason (below). Two gloo pools (2 and 4 ranks) serve every case, so the zoo pays process
start-up twice. Tolerance 1e-5 relative to the output's magnitude, float32 with sums reordered (test_tp_numerics).

The Ulysses modes run at odd lengths (``zoo.odd_sizes``: 7 text rows, parts with different remainders over the degree, as
pipelines pass them), and every attention of the model must run sequence-sharded (``SEQUENCE_SHARDED`` pins how
many there are), so a rule change that silently stops sharding one fails here.
"""

from __future__ import annotations

import math

import pytest

from partitioner.testing import RankPool
from partitioner.testing.zoo import ZOO, odd_sizes
from partitioner.testing.zoo_check import MODES, partition_case

# Deliberate limits: the model's own code does what no static partition can serve.
# (Lumina2 branches on its mask's row sums and Mochi drops padded prompt rows by `nonzero`: both are traced for
# the example's mask, value_specialization.)
REFUSED = {
    # mixture-of-experts routing on activations through `.cpu().numpy()` (export refuses it)
    "hidream": ("TraceError", "transformer_hidream_image.py:389"),
}
# attentions sequence-sharded under ulysses=2, of the model's SDPA attentions: every self, joint and cross attention
# (H3's text refiner on its own text rows, gathered once after it). Sana's self-attention is linear attention (not
# SDPA): its rows stay split through it and through the depthwise convolution (a halo exchange), so its
# cross-attentions run on this rank's query rows. Mochi's time-embedding pooling (one query over the text rows) has no
# rows to split: it runs whole on every rank and is not counted.
SEQUENCE_SHARDED = {"flux": 4, "flux2": 4, "sd3": 2, "auraflow": 4, "pixart_sigma": 4, "wan": 4, "ltx_video": 4,
                    "allegro": 4, "cogvideox": 2, "cogview4": 2, "qwen_image": 2, "minimax_h3": 3,
                    "hunyuan_video": 5, "sana": 2, "lumina2": 4, "mochi": 2, "chroma": 4, "bria": 4, "skyreels_v2": 4,
                    "chronoedit": 4, "wan_vace": 8, "kandinsky5": 5, "easyanimate": 2, "hunyuan_video15": 3,
                    "nucleus_moe": 5}


@pytest.fixture(scope="module")
def pools():
    with RankPool(2) as two, RankPool(4) as four:
        yield {2: two, 4: four}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_is_exact_or_refused_for_a_documented_reason(pools, name, mode):
    shape, names = MODES[mode]
    sizes = odd_sizes(name) if "ulysses" in names else None
    results = pools[math.prod(shape)].run(partition_case, name, shape, names, sizes)
    if name in REFUSED:
        error_type, where = REFUSED[name]
        assert all(r["status"] == "refused" and r["error_type"] == error_type for r in results), results[0]
        assert where in results[0]["message"], results[0]
        return
    for rank, result in enumerate(results):
        assert result["status"] == "exact", (rank, result)
    if "ulysses" in names:
        assert results[0]["attention_sharded"] == results[0]["attentions"] == SEQUENCE_SHARDED[name], results[0]
        if name == "sana":  # the linear attentions' states summed, the depthwise convolutions' rows borrowed
            assert {"all_reduce:ulysses", "halo_exchange:ulysses"} <= set(results[0]["collectives"]), results[0]
    if "tp" in names:
        assert results[0]["collectives"].get("all_reduce:tp", 0) > 0


@pytest.mark.parametrize("name", ["lumina2", "flux"])
def test_ring_and_ulysses_compose(pools, name):
    """ring=2 x ulysses=2 shards the rows over both axes, ring outer. Lumina2's rotary table is split by Ulysses
    and whole over the ring where the query both split reads it: this rank's rows of it are not all here, so the
    Ulysses split is gathered first and both slices taken (insert_collectives); exact, every attention sharded."""
    results = pools[4].run(partition_case, name, (2, 2), ("ring", "ulysses"), dict(text=7))
    for rank, result in enumerate(results):
        assert result["status"] == "exact", (rank, result)
    assert results[0]["attention_sharded"] == results[0]["attentions"] == SEQUENCE_SHARDED[name], results[0]
