"""Run a function on N local gloo ranks (loopback only) and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, Path(out_dir) / f"{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; returns the per-rank results in rank order.
    ``fn`` must be importable (a module-level function)."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world,
                               start_method="spawn", join=True)
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is reported below
        results = []
        for rank in range(world):
            path = Path(out_dir) / f"{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} died without a result")
            payload = torch.load(path, weights_only=False)
            if "error" in payload:
                raise RuntimeError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["ok"])
        return results
