"""The Inductor backend and the torch.compile entry point, on real gloo ranks.

Tolerance: Inductor fuses and reorders float32 arithmetic (reductions, fused multiply-adds), so compiled and eager
runs of the same rank graph differ by a few ulps; the same 1e-5 bound as the eager numerics tests holds with a wide
margin (measured below 1e-6).
"""

from __future__ import annotations

import subprocess
import sys
import traceback

import pytest
import torch

from partitioner.testing import TINY_H3, attempt, h3_inputs, run_ranks, tiny_h3

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
LAYOUTS = {"tp2": ((2,), ("tp",)), "u2": ((2,), ("ulysses",)), "tp2_u2": ((2, 2), ("tp", "ulysses")),
           "ring2": ((2,), ("ring",))}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _inductor_vs_eager(rank: int, world: int, layout: str) -> dict:
    import partitioner

    model, inputs = tiny_h3(num_attention_heads=6), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    partitioned = partitioner.partition(model, _mesh(*LAYOUTS[layout]), ((), inputs))
    eager = partitioned.compile("eager")(**inputs, return_dict=False)
    compiled = partitioned.compile("inductor")
    first = compiled(**inputs, return_dict=False)
    again = compiled(**inputs, return_dict=False)
    # rank 1 called with other latents: refused on every rank where the regions settle the agreement, before the
    # first region with a collective (after compute), in the user's words; the partition stays usable
    from partitioner.runtime import agreement

    other = dict(inputs, hidden_states=inputs["hidden_states"] + rank)
    settled_in, settle = [], agreement.PendingAgreement._settle
    agreement.PendingAgreement._settle = lambda pending: (
        settled_in.extend(frame.f_code.co_name for frame, _ in traceback.walk_stack(None)), settle(pending))[1]
    try:
        refused = attempt(lambda: compiled(**other, return_dict=False))
    finally:
        agreement.PendingAgreement._settle = settle
    after = compiled(**inputs, return_dict=False)
    return dict(expected=expected, eager=eager, inductor=first, again=again, refused=refused, after=after,
                settled_in_a_region="call_module" in settled_in)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inductor_matches_eager_and_single_device(layout):
    """TP, Ulysses, TP x Ulysses and ring: the Inductor-compiled rank graph (collectives included) gives the eager
    backend's outputs and the single device's, on every rank; the second call reuses the compiled code."""
    shape, _ = LAYOUTS[layout]
    for result in run_ranks(int(torch.tensor(shape).prod()), _inductor_vs_eager, layout):
        for compiled, eager, expected in zip(result["inductor"], result["eager"], result["expected"]):
            torch.testing.assert_close(compiled, eager, **TOLERANCE)
            torch.testing.assert_close(compiled, expected, **TOLERANCE)
        for first, again, after in zip(result["inductor"], result["again"], result["after"]):
            assert torch.equal(first, again) and torch.equal(first, after)
        kind, message, _ = result["refused"]
        assert kind == "InputError" and "hidden_states" in message and "While executing" not in message, message
        assert result["settled_in_a_region"]  # (by the regions' interpreter, after the glue ahead of them)


def _compile_counts(rank: int, world: int) -> dict:
    import partitioner

    counts = {}
    for blocks in (2, 6):
        model = tiny_h3(num_layers=blocks)
        inputs = h3_inputs(TINY_H3)
        partitioned = partitioner.partition(model, _mesh((world,), ("tp",)), ((), inputs))
        compiled = partitioned.compile("inductor")
        out = compiled(**inputs, return_dict=False)
        with torch.no_grad():
            expected = model(**inputs, return_dict=False)
        counts[blocks] = (vars(compiled.stats), [float((a - b).abs().max()) for a, b in zip(out, expected)])
    whole = partitioner.partition(tiny_h3(num_layers=2), _mesh((world,), ("tp",)), ((), h3_inputs(TINY_H3)))
    compiled = whole.compile("inductor", regional=False)
    compiled(**h3_inputs(TINY_H3))
    counts["whole"] = vars(compiled.stats)
    return counts


def test_regional_compilation_compiles_a_repeated_block_once():
    """Compilations do not grow with depth: with 2 or 6 transformer blocks, one compilation serves every
    transformer block and one the refiner block; the glue between them runs eagerly. Whole-graph compilation stays
    available and compiles once."""
    (counts,) = run_ranks(1, _compile_counts)
    two, six = counts[2][0], counts[6][0]
    assert two["compilations"] == six["compilations"] == 2
    assert six["regions"] - two["regions"] == 4
    assert sorted(six["reused"].values()) == [1, 6]
    assert max(counts[6][1]) < 1e-5 and max(counts[2][1]) < 1e-5
    assert counts["whole"] == {"regions": 1, "compilations": 1, "reused": {}}


def _compile_twice(rank: int, world: int, cache_dir: str) -> dict:
    import os

    from torch._dynamo.utils import counters
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from partitioner.backends.inductor import _compile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    envs, init = [], ShapeEnv.__init__
    ShapeEnv.__init__ = lambda self, *a, **k: envs.append(self) or init(self, *a, **k)

    class Region(torch.nn.Module):
        def forward(self, x, w):
            return (torch.nn.functional.gelu(x @ w).sum(-1) + x[:, :3].mean(-1),)

    gm, args = torch.fx.symbolic_trace(Region()), [torch.randn(5, 7), torch.randn(7, 6)]
    counters.clear()
    outputs = [_compile(gm, args)(*args) for _ in range(2)]
    symbols = [str(symbol) for env in envs for symbol in env.var_to_val]
    return dict(symbols=symbols, cache=dict(counters["inductor"]), outputs=outputs, expected=gm(*args))


def test_a_region_compiles_with_static_shapes_and_a_second_start_hits_the_cache(tmp_path):
    """Each region compiles for its example's shapes, as torch.compile's first compilation does: no size becomes a
    symbol (given real tensors, AOTAutograd would make every size a symbol; symbolic index expressions cost 1.6x
    the compile time after a collective); compiling it again (another rank, a restart) reads Inductor's FX graph
    cache."""
    (result,) = run_ranks(1, _compile_twice, str(tmp_path))
    assert result["symbols"] == []
    assert result["cache"].get("fxgraph_cache_miss") == 1 and result["cache"].get("fxgraph_cache_hit") == 1, \
        result["cache"]
    for output in result["outputs"]:
        torch.testing.assert_close(list(output), list(result["expected"]))


def _torch_compile(rank: int, world: int) -> dict:
    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    compiled = torch.compile(model, backend="partitioner", options={"mesh": _mesh((world,), ("tp",))})
    with torch.no_grad():
        actual = compiled(**inputs, return_dict=False)
        as_output = compiled(**inputs)
    return dict(expected=expected, actual=actual, as_output=as_output)


def test_torch_compile_backend_matches_single_device():
    """torch.compile(model, backend="partitioner", options={"mesh": mesh}) at TP=2 equals the single-device model."""
    for result in run_ranks(2, _torch_compile):
        for actual, expected in zip(result["actual"], result["expected"]):
            torch.testing.assert_close(actual, expected, **TOLERANCE)
        torch.testing.assert_close(result["as_output"].sample, result["expected"][0], **TOLERANCE)


def test_entry_point_resolves_in_a_fresh_interpreter():
    """The backend is found through the torch_dynamo_backends entry point, without importing partitioner."""
    code = ("import sys, torch\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "assert 'partitioner' not in sys.modules\n"
            "backend = lookup_backend('partitioner')\n"
            "print(backend.__module__, backend.__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["partitioner.frontend.dynamo", "partitioner_backend"]


def test_torch_compile_backend_needs_a_mesh():
    from partitioner.frontend.dynamo import partitioner_backend

    with pytest.raises(ValueError, match="'mesh' required"):
        partitioner_backend(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)], {"backend": "eager"})


def _compiled_order(rank: int, world: int, keep: bool) -> list[str]:
    """The compiled code's order of an all_reduce issued, a matmul that does not need it, and its wait."""
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from partitioner.backends import inductor

    functional, group = torch.ops._c10d_functional, dist.group.WORLD.group_name

    def step(x, w):
        issued = functional.all_reduce.default(x * 2, "sum", group)
        independent = torch.mm(w, w).sin()
        return functional.wait_tensor.default(issued) + independent

    if not keep:
        inductor.KEEP_COLLECTIVE_SCHEDULE = {}
    gm, args = torch.fx.symbolic_trace(step), [torch.randn(16, 16), torch.randn(16, 16)]
    _, (code,) = run_and_get_code(lambda: inductor._compile(gm, args))
    calls = code[code.index("def call"):].splitlines()
    return [kind for line in calls for kind in ("functional.all_reduce_", "extern_kernels.mm", "wait_tensor")
            if kind in line and not line.strip().startswith("#")]


def test_inductor_keeps_the_schedule_of_collectives():
    """schedule_collectives waits after independent compute; Inductor's reordering for peak memory would run the
    wait right after its issue (a wait frees the send buffer), so nothing overlaps: it is off for our regions.
    The control: with Inductor's defaults, the wait moves up."""
    assert run_ranks(1, _compiled_order, True)[0] == ["functional.all_reduce_", "extern_kernels.mm", "wait_tensor"]
    assert run_ranks(1, _compiled_order, False)[0] == ["functional.all_reduce_", "wait_tensor", "extern_kernels.mm"]
