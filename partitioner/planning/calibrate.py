"""``partitioner calibrate``: measure this machine as a device profile the planner can use.

Each rank of a CPU run is one process; ``threads`` is how many threads it computes with (the multi-rank tests and
benchmarks use one). Measured with every rank measuring at once (they share the memory bus as in a run): a
float32 matmul's rate, a large add's memory bandwidth, gloo's all_reduce between the ranks, small (latency)
and large (bandwidth), its reduce_scatter against that all_reduce, and how much of an all_reduce a matmul running
meanwhile hides (overlap). All ranks sit on this host: one "chip".
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from .cost import DeviceProfile


def _best_of(repeats: int, fn) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _best_of(repeats, lambda: a @ b) / 1e12


def memory_gbps(numel: int = 2**25, repeats: int = 5) -> float:
    """Bytes read and written by ``a + b`` (two reads, one write) per second."""
    a, b = torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel)
    return 3 * 4 * numel / _best_of(repeats, lambda: torch.add(a, b, out=out)) / 1e9


def _probe(rank: int, world: int, port: int, threads: int, repeats: int, results) -> None:
    """One rank's measurements, every rank measuring at the same time: ranks share the host's memory bus and
    caches as they do in a run."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dist.barrier()
        rate = matmul_tflops()
        dist.barrier()
        memory = memory_gbps()
        times = []
        for numel in (SMALL, LARGE):
            x = torch.ones(numel)

            def reduce():
                dist.all_reduce(x)
                dist.barrier()
            times.append(_best_of(repeats, reduce))
        x, piece = torch.ones(LARGE), torch.empty(LARGE // world)

        def scatter():
            dist.reduce_scatter_tensor(piece, x)
            dist.barrier()
        times.append(_best_of(repeats, scatter))
        hidden = overlap_share(repeats)
        if rank == 0:
            results.put((rate, memory, *times, hidden))
    finally:
        dist.destroy_process_group()


SMALL, LARGE = 2, 2**22  # float32 elements: 8 bytes (latency), 16 MiB (bandwidth)


def overlap_share(repeats: int, size: int = 1024) -> float:
    """The share of an all_reduce's time a matmul running meanwhile hides: a 16 MiB all_reduce (t_c) and a
    matmul of about the same time (t_m) alone, then the all_reduce issued, the matmul run, the all_reduce waited
    on (t_both), medians: (t_m + t_c - t_both) / min(t_m, t_c), from 0 (they only contend) to 1 (fully hidden)."""
    x, a, b = torch.ones(LARGE), torch.randn(size, size), torch.randn(size, size)

    def reduce():
        dist.all_reduce(x)
        dist.barrier()

    def both():
        work = dist.all_reduce(x, async_op=True)
        a @ b
        work.wait()
        dist.barrier()

    def matmul():
        a @ b
        dist.barrier()
    times = {fn: [] for fn in (reduce, matmul, both)}
    for _ in range(repeats + 1):  # taking turns, so that the machine's drift hits all three alike
        for fn, measured in times.items():
            start = time.perf_counter()
            fn()
            measured.append(time.perf_counter() - start)
    t_c, t_m, t_both = (statistics.median(measured[1:]) for measured in times.values())
    return min(1.0, max(0.0, (t_m + t_c - t_both) / min(t_m, t_c)))


def measure(ranks: int, threads: int, repeats: int = 10) -> tuple[float, float, float, float, float, float]:
    """(matmul TFLOP/s, memory GB/s, latency us per step, gloo GB/s, overlap share, reduce-scatter share) of one
    rank while ``ranks`` run at once.
    A ring all-reduce over 2 ranks takes 2 steps and moves the message once each way: t = 2 x latency + bytes /
    bandwidth. The barrier after each call adds about one more small message, measured with the small size and
    so subtracted."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_probe, args=(ranks, port, threads, repeats, results), nprocs=ranks, start_method="spawn")
    rate, memory, t_small, t_large, t_scatter, hidden = results.get()
    latency = t_small / (2 * (ranks - 1) + 1)  # the all-reduce's steps and the barrier's one
    bandwidth = LARGE * 4 * 2 * (ranks - 1) / ranks / max(t_large - t_small, 1e-9) / 1e9
    scatter_share = min(1.0, max(0.05, (t_scatter - t_small) / max(t_large - t_small, 1e-9)))
    return rate, memory, latency * 1e6, bandwidth, hidden, scatter_share


def calibrate(threads: int = 1, ranks: int | None = None) -> DeviceProfile:
    """This host as a device profile: one rank is a process of ``threads`` threads, and ``ranks`` of them (default:
    as many as the cores hold) run at once while measuring."""
    cores = os.cpu_count() or 1
    ranks = ranks or max(2, cores // threads)
    rate, memory, latency, bandwidth, hidden, scatter_share = measure(ranks, threads)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = (f"measured by `partitioner calibrate --threads {threads}` on {date.today()}, {ranks} ranks at once "
             f"on {cores} cores")
    return DeviceProfile(
        name="cpu-gloo", matmul_tflops=round(rate, 4), memory_gbps=round(memory, 2), memory_bytes=ram // ranks,
        ranks_per_chip=ranks, local_gbps=round(bandwidth, 3), link_gbps=round(bandwidth, 3),
        latency_us=round(latency, 1), overlap=round(hidden, 2), reduce_scatter_share=round(scatter_share, 2),
        sources={"device": f"one rank of a CPU run: a process of {threads} thread(s); every rank on this host",
                 "matmul_tflops": f"float32 1024 x 1024 matmul, best of 5, {where}",
                 "memory_gbps": f"a + b over 2^25 float32 elements (3 x 128 MiB moved), best of 5, {where}",
                 "memory_bytes": "this host's physical memory / ranks",
                 "local_gbps": f"gloo all_reduce of 16 MiB, best of 10, {where}",
                 "link_gbps": "the same as local_gbps: there is no second chip",
                 "latency_us": f"gloo all_reduce of 8 bytes, best of 10, {where}",
                 "overlap": f"a 16 MiB all_reduce and a 1024 x 1024 matmul, alone and at once, medians of 10, "
                            f"{where}",
                 "reduce_scatter_share": f"gloo reduce_scatter against all_reduce of 16 MiB, best of 10, {where}"})
