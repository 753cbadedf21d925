"""Local ranks for examples and tests: gloo processes (``run_ranks``, a ``RankPool`` kept alive across cases,
``launch`` under torchrun or its own spawn), PyTorch's fake process group for large meshes, and fault injection."""

from __future__ import annotations

import contextlib
import math
import multiprocessing.util
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import PartitionerError


class RankFailure(PartitionerError, RuntimeError):
    """A local rank of ``run_ranks`` / ``RankPool`` failed; the message holds its traceback."""


def _worker(rank: int, world: int, out_dir: str, fn, args) -> None:
    # Rendezvous through a file, not a TCP port: no race for a free port between parallel tests. Gloo's own
    # connections use loopback ports the OS assigns.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    _fresh_seed()
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, Path(out_dir) / f"{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()
    _exit_rank()


def _exit_rank() -> None:
    """End a rank process without the interpreter's teardown: with compile workers alive, torch 2.9 can abort there
    ("terminate called without an active exception") after the rank's work is done and saved. multiprocessing's
    own exit handlers still run first: they unlink the semaphores this process created (tqdm's lock, made by the
    first progress bar, e.g. torch.fx's interpreter), which the resource tracker would otherwise report as leaked
    when the launcher exits."""
    multiprocessing.util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What every rank imports: a forkserver that imported it once forks each rank from it, without each rank importing
# torch, diffusers and this package again (5 to 8 s per rank on 2 cores). Unlike spawn, every rank shares the
# server's string-hash seed and imports what the server found on its path; its torch seed is drawn afresh
# (``_fresh_seed``). The rank-agreement tests keep spawn: ranks there must be as independent as a job's.
_PRELOAD = ["torch", "torch.distributed", "torch.export", "partitioner", "partitioner.testing", "diffusers",
            "transformers"]


def start_method() -> str:
    """"forkserver" where the platform has it (its server preloads ``_PRELOAD``), else "spawn". The server starts
    on first use, with the environment and the standard streams of that moment: a rank sees those, not the
    caller's later ones (``start_ranks_server`` starts it early)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # (no effect once the server runs)
    return "forkserver"


def start_ranks_server(output: str | None = None) -> None:
    """Start the server ranks fork from now, with the current environment (a test session's, before any test
    changes it); with ``output``, the ranks' stdout and stderr go to that file (a rank's own traceback still
    reaches the caller in ``RankFailure``)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver
    if output is None:
        forkserver.ensure_running()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(output, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            forkserver.ensure_running()
    finally:
        for fd, copy in enumerate(saved, start=1):
            os.dup2(copy, fd)
            os.close(copy)


def _fresh_seed() -> None:
    """A forked rank starts from the server's torch seed, the same on every rank: draw its own, as a spawned one
    has (a rank that forgets to seed must not agree with the others by accident)."""
    torch.seed()


def run_ranks(world: int, fn, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; returns the per-rank results in rank order.
    ``fn`` must be importable (a module-level function)."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world, out_dir, fn, args), nprocs=world,
                               start_method=start_method(), join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the rank's own traceback, or its missing result, is reported below
        results = []
        for rank in range(world):
            path = Path(out_dir) / f"{rank}.pt"
            if not path.exists():
                raise RankFailure(f"rank {rank} died without a result")
            payload = torch.load(path, weights_only=False)
            if "error" in payload:
                raise RankFailure(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["ok"])
        return results



@contextlib.contextmanager
def broken_rule(target, rule):
    """Test-only fault injection: plan with ``rule`` for the op ``target``, as a bug in a rule would (``verify``
    must find what it breaks)."""
    from ..rules import RULES

    keys = [(kind, target) for kind in ("any", "tensor", "sequence")]  # it replaces every axis kind's rule
    saved = {key: RULES.get(key) for key in keys}
    for key in keys:
        RULES[key] = rule
    try:
        yield
    finally:
        for key, previous in saved.items():
            if previous is None:
                del RULES[key]
            else:
                RULES[key] = previous


def drop_all_reduce(partitioned, module_path: str) -> None:
    """Test-only fault injection (a negative control): bypass the all_reduce after ``module_path``'s linear in this
    rank's graph, leaving its output a per-rank partial sum."""
    graph = partitioned.graph_module.graph
    reduce = next(n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
                  and list(n.meta["nn_module_stack"].values())[-1][0] == module_path)
    wait = next(iter(reduce.users))
    wait.replace_all_uses_with(reduce.args[0])
    graph.erase_node(wait)
    graph.erase_node(reduce)
    partitioned.graph_module.recompile()


def _pool_worker(rank: int, world: int, out_dir: str, tasks, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    _fresh_seed()
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    for fn, args in iter(tasks.get, None):
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        except BaseException as error:  # reported to the test, which decides
            results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    _exit_rank()


class RankPool:
    """``world`` gloo ranks kept alive between tasks, so that many small cases (a property test's examples) pay
    for process start-up and imports once: ``pool.run(fn, *args)`` runs ``fn(rank, world, *args)`` on every rank
    and returns the results in rank order. Use as a context manager."""

    def __init__(self, world: int):
        context = mp.get_context(start_method())
        self.world, self.dir = world, tempfile.TemporaryDirectory()
        self.tasks = [context.Queue() for _ in range(world)]
        self.results = context.Queue()
        self.processes = [context.Process(target=_pool_worker, daemon=True,
                                          args=(rank, world, self.dir.name, self.tasks[rank], self.results))
                          for rank in range(world)]
        for process in self.processes:
            process.start()

    def run(self, fn, *args, timeout: float = 300) -> list:
        for queue in self.tasks:
            queue.put((fn, args))
        results = {}
        for _ in range(self.world):
            rank, kind, value = self.results.get(timeout=timeout)
            if kind == "error":
                raise RankFailure(f"rank {rank} failed:\n{value}")
            results[rank] = value
        return [results[rank] for rank in range(self.world)]

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self.dir.cleanup()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(world: int, fn, *args) -> list | None:
    """``fn(rank, world, *args)`` on every rank, under torchrun (this process is one rank: the group is initialised
    from its environment) or, run directly, on ``world`` local processes. Returns the per-rank results on rank 0
    (and when run directly), None on the other ranks."""
    if "RANK" not in os.environ:
        return run_ranks(world, fn, *args)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = [None] * world
        dist.all_gather_object(results, fn(rank, world, *args))
        return results if rank == 0 else None
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...], rank: int):
    """A DeviceMesh on PyTorch's fake process group: plan rank ``rank`` of a large job in this one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def attempt(call) -> tuple[str, str, float]:
    """(outcome class name, message, seconds) of a call: "returned" when it did not raise. A fault test asserts
    the class and message on every rank, and that it ended within the partition's timeout."""
    start = time.monotonic()
    try:
        call()
        return "returned", "", time.monotonic() - start
    except Exception as error:  # the caller asserts which class
        return type(error).__name__, str(error), time.monotonic() - start


__all__ = ['RankFailure', 'RankPool', 'attempt', 'broken_rule', 'drop_all_reduce', 'fake_mesh', 'launch',
           'run_ranks']
