"""Checks of the zoo (``partitioner.testing.zoo``): each model's eager run, export and full parameter count
(``python -m partitioner.testing.zoo_check [name ...]``), and one model partitioned on one mesh on every rank
(``partition_case``: the zoo test and ``benchmarks/zoo.py``)."""

from __future__ import annotations

import torch

from .zoo import ZOO, build, inputs


# --- self-check ------------------------------------------------------------------------------------------------------

def _first_tensor(out):
    """The sample tensor of a model output (ModelOutput, tuple or tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return _first_tensor(out[0])


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def check(name: str) -> dict:
    """Eager (finite, deterministic across two calls), ``torch.export`` (strict=False) and the full param count."""
    import time


    start, result = time.perf_counter(), {}
    model = build(name)
    args, kwargs = inputs(name)
    result["tiny_params"], first = _params(model), None
    try:
        with torch.no_grad():
            first, second = _first_tensor(model(*args, **kwargs)), _first_tensor(model(*args, **kwargs))
        ok = bool(torch.isfinite(first).all()) and torch.equal(first, second)
        result["eager"] = f"ok {tuple(first.shape)}" if ok else "not finite or not deterministic"
    except Exception as e:  # noqa: BLE001  (a report, not a test)
        result["eager"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        with torch.no_grad():
            program = torch.export.export(model, args, kwargs, strict=False)
            exported = _first_tensor(program.module()(*args, **kwargs))
        if first is None:
            result["export"] = "ok (no eager output to compare)"
        else:
            same = torch.allclose(exported, first, rtol=1e-4, atol=1e-5)
            result["export"] = "ok" if same else "exported, but its output differs from eager"
    except Exception as e:  # noqa: BLE001
        result["export"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    try:
        result["full_params"] = _human(_params(build(name, full=True))) if ZOO[name].full is not None else "-"
    except Exception as e:  # noqa: BLE001
        result["full_params"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    result["seconds"] = time.perf_counter() - start
    return result


# ---- one zoo model partitioned on one mesh, on every rank (the zoo test and benchmarks/zoo.py) ----

MODES = {"tp2": ((2,), ("tp",)), "ulysses2": ((2,), ("ulysses",)), "tp2xulysses2": ((2, 2), ("tp", "ulysses"))}


def partition_case(rank: int, world: int, name: str, shape: tuple, names: tuple, sizes: dict | None = None) -> dict:
    """Partition zoo model ``name`` (inputs of ``sizes``, default the builder's) on a ``shape``/``names``
    DeviceMesh of the running ranks and compare this rank's output with the unpartitioned model's:
    ``{"status": "exact" | "refused", ...}`` with the error, the refusal's class and message, the replicated share
    of parameter bytes, collectives, attentions sequence-sharded over every sequence axis and seconds spent
    partitioning."""
    return model_case(rank, world, build(name), inputs(name, **(sizes or {})), shape, names)


def model_case(rank: int, world: int, model, example: tuple, shape: tuple, names: tuple) -> dict:
    """``model`` partitioned on a ``shape``/``names`` DeviceMesh of the running ranks with ``example = (args,
    kwargs)``, this rank's output against the model's (``partition_case``'s result)."""
    import time
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from .. import partition
    from ..errors import PartitionerError

    args, kwargs = example
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            partitioned = partition(model, mesh, (args, kwargs))
        seconds = time.perf_counter() - start
        got = _first_tensor(partitioned.compile()(*args, **kwargs))
    except PartitionerError as error:
        return dict(status="refused", error_type=type(error).__name__,
                    message=" ".join(str(error).splitlines()[:2])[:500])
    with torch.no_grad():
        expected = _first_tensor(model(*args, **kwargs))
    scale = expected.abs().max().item() or 1.0
    report = partitioned.report()
    sharded, total = report.attentions_sharded or (0, len(partitioned.ctx.sequence_attention))
    return dict(status="exact" if (got - expected).abs().max().item() <= 1e-5 * max(scale, 1.0) else "wrong",
                error=(got - expected).abs().max().item(), scale=scale, replicated=report.replicated_share,
                collectives={f"{kind}:{axis}": n for (kind, axis), n in partitioned.collective_counts().items()},
                attention_sharded=sharded, attentions=total, seconds=seconds,
                unsharded=dict(partitioned.ctx.sequence_whole))


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore")

    names = sys.argv[1:] or list(ZOO)
    print(f"{'model':<14} {'eager':<24} {'tiny':>7} {'full':>7} {'sec':>5}  export")
    for name in names:
        r = check(name)
        print(f"{name:<14} {r['eager'][:24]:<24} {_human(r['tiny_params']):>7} {r['full_params']:>7} "
              f"{r['seconds']:5.1f}  {r['export'][:160]}", flush=True)
