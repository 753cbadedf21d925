"""A pipeline's VAE partitioned by ``parallelize``: its ``decode`` (and ``encode`` where the VAE has one that
partitions) swapped for a ``PartitionedMethod`` that partitions that method over every rank of the mesh at its
first call, the rows of each image or frame split along height over one "ring" axis (``docs/vae.md``), and serves
every later call (other latent sizes are shape specialisations).

The VAE module itself stays whole on every rank: its weights are small; what a decode at 720p holds is activations,
which the split divides. A VAE whose method cannot be partitioned (an op no rule carries the split through) runs
whole, with one ``PartitionWarning`` saying why: an exact run that shards nothing must say so. So does one whose
split fails inside the passes, or on another rank (every rank falls back alike).
"""

from __future__ import annotations

import types
import warnings

import torch

from ..errors import (CollectiveTimeout, ConcurrentCall, FailedOnAnotherRank, PartitionUnusable, PartitionWarning,
                      RankDisagreement)

METHODS = ("decode", "encode")
# Failures of the ranks rather than of the split (ranks holding other weights plan differently): a decode that falls
# back to whole on them would hide them. Every other failure of ``partition`` (a refusal, an internal error of a
# pass, another rank's, which the plan check raises on every rank as ``FailedOnAnotherRank``) is raised on every
# rank alike, so every rank decodes whole.
_RANK_FAILURES = (RankDisagreement, CollectiveTimeout, ConcurrentCall, PartitionUnusable)


def ring_over_all_ranks(mesh):
    """A one-axis DeviceMesh named "ring" over the ranks of ``mesh`` (None for axis sizes: planning only)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        return None
    return DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=("ring",))


class PartitionedMethod:
    """``module.<method>`` partitioned over ``mesh`` at its first call (that call's arguments are the example)."""

    def __init__(self, module: torch.nn.Module, method: str, mesh, where: str, *, backend: str = "eager",
                 compile_options: dict | None = None, **partition_options):
        self.module, self.method, self.mesh, self.where = module, method, mesh, where
        self.backend, self.compile_options, self.options = backend, dict(compile_options or {}), partition_options
        self.compiled, self.whole_because = None, None
        self.__doc__ = getattr(type(module), method).__doc__

    @property
    def partitioned(self):
        """The ``Partitioned`` of the first call's shapes (None before it, or when the method runs whole)."""
        return self.compiled.partitioned if self.compiled is not None else None

    def whole(self, *args, **kwargs):
        return getattr(type(self.module), self.method)(self.module, *args, **kwargs)

    def _runs_whole_because(self, error: Exception) -> None:
        self.whole_because = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        warnings.warn(f"{self.where}.{self.method} runs whole on every rank (not partitioned): {self.whole_because}",
                      PartitionWarning, stacklevel=3)

    def __call__(self, *args, **kwargs):
        if self.compiled is None and self.whole_because is None:
            from ..api import partition

            try:
                partitioned = partition(self.module, self.mesh, (args, kwargs), method=self.method, **self.options)
            except FailedOnAnotherRank as error:
                self._runs_whole_because(error)
            except _RANK_FAILURES:  # ranks out of step: running whole would hide it
                raise
            except Exception as error:  # noqa: BLE001 (every rank failed alike: the plan check saw to it)
                self._runs_whole_because(error)
            else:
                self.compiled = partitioned.compile(self.backend, **self.compile_options)
        if self.compiled is None:
            return self.whole(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def partition_vae(vae: torch.nn.Module, mesh, where: str, **options) -> list[str]:
    """Swap ``vae``'s decode and encode for ``PartitionedMethod``s over every rank of ``mesh``; the methods
    swapped (none for a mesh of axis sizes, which cannot run)."""
    ring = ring_over_all_ranks(mesh)
    if ring is None or ring.size() == 1:
        return []
    swapped = []
    for method in METHODS:
        if isinstance(getattr(type(vae), method, None), types.FunctionType):
            vae.__dict__[method] = PartitionedMethod(vae, method, ring, where, **options)
            swapped.append(method)
    return swapped
