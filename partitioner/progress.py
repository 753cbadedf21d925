"""Progress bars for the long steps (tracing and the passes over a full-size model, the layout search, shard-on-read
loading, Inductor's compilation): tqdm, as diffusers shows its denoising steps, on rank 0 only; silent where stderr is
not a terminal, and switched by ``PARTITIONER_PROGRESS`` ("0": never, "1": even where stderr is not a terminal)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys

from tqdm.auto import tqdm

_inner = contextvars.ContextVar("partitioner_progress_inner", default=False)


@contextlib.contextmanager
def inner_steps_quiet(quiet: bool = True):
    """The steps of a step that shows its own bar (a search partitions every layout) show none of their own
    (``quiet=False``: that step's own bar, made inside)."""
    token = _inner.set(quiet)
    try:
        yield
    finally:
        _inner.reset(token)


def shown() -> bool:
    setting = os.environ.get("PARTITIONER_PROGRESS", "")
    if setting == "0" or _inner.get():
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False  # one bar per job, not one per rank
    return setting == "1" or sys.stderr.isatty()


def bar(iterable=None, *, desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand), cleared when done; a no-op where not ``shown()``."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, disable=not shown(), file=sys.stderr,
                dynamic_ncols=True)
