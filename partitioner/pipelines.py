"""``parallelize(pipe, mesh)``: a whole diffusers pipeline on a mesh in one line, as ``enable_parallelism`` does.

The pipeline's transformer is swapped for a module that partitions it at its first call, with that call's inputs
as the example (a pipeline's first denoising step), and serves every later call (``PartitionedModule``: shape
specialisations for other steps and requests). A transformer built on the meta device is filled from
``checkpoint`` (each rank reads only its slices), so no rank ever holds the whole model.
"""

from __future__ import annotations

import inspect

import torch

from .errors import InputError


class LazyPartition(torch.nn.Module):
    """Partitions ``model`` over ``mesh`` at the first call; then every call runs the partitioned module."""

    def __init__(self, model: torch.nn.Module, mesh, *, checkpoint=None, backend: str = "eager",
                 compile_options: dict | None = None, **partition_options):
        super().__init__()
        if checkpoint is None and any(p.is_meta for p in model.parameters()):
            raise InputError(f"{type(model).__name__} is on the meta device: give parallelize(..., checkpoint=path) "
                             "to load each rank's slices")
        self._model, self._mesh, self._checkpoint = model, mesh, checkpoint
        self._backend, self._compile_options, self._options = backend, dict(compile_options or {}), partition_options
        self._module = None
        self.config = getattr(model, "config", None)
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

        def forward(*args, **kwargs):
            return self._call(*args, **kwargs)

        forward.__signature__ = inspect.signature(model.forward)
        self.forward = forward

    @property
    def partitioned(self):
        return self._module.partitioned if self._module is not None else None

    def _call(self, *args, **kwargs):
        if self._module is None:
            from .api import partition

            partitioned = partition(self._model, self._mesh, (args, kwargs), **self._options)
            if self._checkpoint is not None:
                partitioned.load_weights(self._checkpoint)
            self._module = partitioned.compile(self._backend, **self._compile_options)
            self._model = None  # the partition holds this rank's shards and a skeleton, not the whole model
        return self._module(*args, **kwargs)


def parallelize(pipe, mesh, *, component: str = "transformer", checkpoint=None, **options):
    """Swap ``pipe.<component>`` (default ``transformer``) for a ``LazyPartition`` over ``mesh`` and return the
    pipeline. ``options`` go to ``partition`` (``plan``, ``timeout``, ...) and to ``LazyPartition`` (``backend``,
    ``compile_options``). Every rank runs the pipeline with the same inputs (its own random state is not shared:
    seed every rank alike)."""
    model = getattr(pipe, component, None)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"the pipeline has no module {component!r} to parallelize; name it with component=")
    lazy = LazyPartition(model, mesh, checkpoint=checkpoint, **options)
    try:
        setattr(pipe, component, lazy)
    except Exception:  # a pipeline that registers its components (diffusers) and refuses another type
        object.__setattr__(pipe, component, lazy)
    return pipe
