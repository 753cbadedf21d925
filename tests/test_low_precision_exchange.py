"""``partition(..., exchange_dtype=)``: Ulysses' all_to_all pieces travel in float8 with a float32 scale per row (or
in bfloat16) and are restored on arrival.

Error bound. e4m3 keeps 3 mantissa bits: a value scaled into its normal range is rounded by at most 2^-4 of itself,
and no value of a row is smaller than the subnormal step of 2^-9 of the row's largest relative to it, so each
element is off by at most 2^-4 |x| + 2^-10 max|row| (e5m2: 2^-3 |x|, its subnormals finer). Through a model the
exchanged error averages over many rows: the tiny models measure 1e-3 (e4m3) relative L2 at the output; the test
asserts below 2e-2, the bound the issue sets for the latents, and above 1e-5 (the exchange did round: an exact
output would mean the option was silently ignored).
"""

from __future__ import annotations

import math

import pytest
import torch

from partitioner.runtime import low_precision
from partitioner.testing import attempt, cogvideox_inputs, flux_inputs, run_ranks, tiny_cogvideox, tiny_flux

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype, relative", [(E4M3, 2 ** -4), (E5M2, 2 ** -3), (torch.bfloat16, 2 ** -8)])
def test_a_piece_round_trips_within_its_dtype_precision(dtype, relative):
    x = torch.randn(3, 5, 16) * torch.logspace(-3, 3, 16)  # rows spanning six decades
    x[1, 2] = 0  # an all-zero row keeps a finite scale
    encoded = low_precision.encode(x, dtype, rows=2)
    assert encoded.dtype == torch.uint8 and encoded.numel() == low_precision.encoded_bytes(x.shape, dtype, 2)
    received = torch.cat([torch.zeros(1, dtype=torch.uint8), encoded])[1:]  # at an odd offset, as a piece arrives
    decoded = low_precision.decode(received, x.shape, dtype, torch.float32, 2)
    bound = relative * x.abs() + 2 ** -10 * x.abs().amax(dim=2, keepdim=True)
    assert (decoded - x).abs().le(bound).all()
    assert decoded[1, 2].eq(0).all()


def _flux_case(rank: int, world: int) -> dict:
    import partitioner
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_flux(), flux_inputs()
    with torch.no_grad():
        expected = model(**inputs).sample
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses",))
    found = {}
    for name, dtype in (("exact", None), ("e4m3", E4M3), ("bf16", torch.bfloat16)):
        partitioned = partitioner.partition(model, mesh, ((), inputs), exchange_dtype=dtype)
        compiled = partitioned.compile()
        actual = compiled(**inputs).sample
        if dtype is E4M3:  # a call recording gradients: refused by name (the rounding has no gradient)
            found["gradients"] = attempt(lambda: compiled(**dict(inputs, hidden_states=inputs["hidden_states"]
                                                                 .clone().requires_grad_())).sample.sum().backward())
        found[name] = dict(error=((actual - expected).norm() / expected.norm()).item(),
                           all_to_all=[(c.count, c.bytes_per_call) for c in partitioned.report().collectives
                                       if c.kind == "all_to_all"])
    video = tiny_cogvideox()  # 9 video rows and 8 of text: pieces of 9 and 8 rows
    inputs = cogvideox_inputs(video, frames=3, height=2, width=6)
    with torch.no_grad():
        expected = video(**inputs).sample
    actual = partitioner.partition(video, mesh, ((), inputs), exchange_dtype=E4M3).compile()(**inputs).sample
    found["uneven"] = dict(error=((actual - expected).norm() / expected.norm()).item())
    return found


@pytest.fixture(scope="module")
def ulysses2():
    return run_ranks(2, _flux_case)


def test_float8_exchange_is_close_and_sends_a_third_of_the_bytes(ulysses2):
    head_dim = 16  # tiny Flux: 4 heads x 16; a float32 row of 16 travels as 16 bytes and a 4-byte scale
    for found in ulysses2:
        assert found["exact"]["error"] < 1e-6
        assert 1e-5 < found["e4m3"]["error"] < 2e-2
        assert 1e-5 < found["uneven"]["error"] < 2e-2
        (count, exact), = found["exact"]["all_to_all"]
        (low_count, low), = found["e4m3"]["all_to_all"]
        assert low_count == count and low == exact // 4 * (head_dim + 4) // head_dim
        assert math.isclose(low / exact, (1 + 4 / head_dim) / 4)


def test_gradients_through_a_low_precision_exchange_are_refused_by_name(ulysses2):
    for found in ulysses2:
        kind, message, _ = found["gradients"]
        assert kind == "BackwardUnsupported" and "exchange_dtype is for inference" in message, (kind, message)


def test_bfloat16_exchange_halves_the_bytes(ulysses2):
    for found in ulysses2:
        (_, exact), = found["exact"]["all_to_all"]
        (_, low), = found["bf16"]["all_to_all"]
        assert low * 2 == exact and 1e-7 < found["bf16"]["error"] < 1e-3


def test_exchange_dtype_refusals():
    import partitioner
    from partitioner.errors import InputError

    model, inputs = tiny_flux(), flux_inputs()
    with pytest.raises(InputError, match=r"exchange_dtype=torch.int8: use one of"):
        partitioner.partition(model, {"ulysses": 2}, ((), inputs), exchange_dtype=torch.int8)
    model.train()
    with pytest.raises(InputError, match="is for inference"):
        partitioner.partition(model, {"ulysses": 2}, ((), inputs), exchange_dtype=E4M3)
