"""The mesh a partition is planned for: axis names and sizes, this rank's coordinate, and its process groups.

Two ways in:

- a ``torch.distributed.device_mesh.DeviceMesh`` (real ranks, or PyTorch's fake process group for planning large
  meshes in one process): the graph's collectives name the mesh's real process groups;
- a mapping of axis sizes such as ``{"tp": 8}`` plus a ``rank``: planning only, no process group is needed; the
  collectives name symbolic groups (``"plan:tp"``) and the partition cannot be run.

What a plan may ask of the collectives depends on who runs them (``MeshSpec.programs``): ``"rank"`` programs, one per
rank, run this package's collectives (eager, Inductor, Neuron), which exchange packed and uneven layouts; a
``"global"`` program (XLA SPMD: one process drives every device) leaves the collectives to XLA's partitioner, which
tiles every dim in equal pieces. Both a DeviceMesh and axis sizes plan rank programs, so that a plan read from
sizes is the plan the ranks of a mesh of those sizes run; the global program is asked for by name
(``programs="global"``), for XLA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import MeshError, did_you_mean

BATCH_AXES = ("dp", "cfg")  # data parallelism; "cfg" names it for classifier-free guidance's batch halves
SEQUENCE_AXES = ("ring", "ulysses")  # sequence parallelism: ring attention, Ulysses all-to-all (innermost)
KNOWN_AXES = ("tp",) + SEQUENCE_AXES + BATCH_AXES
PROGRAMS = ("rank", "global")
# What a "cfg" axis divides: "batch", each call's batch (both guidance branches in one call, as data parallelism);
# "pairs", the two calls of a step of a pipeline that guides by calling its denoiser once per branch
# (``runtime.guidance_pairs``): each half of the axis runs one of them, so the program is replicated over it.
CFG_MODES = ("batch", "pairs")


@dataclass(frozen=True)
class MeshSpec:
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    rank: int
    group_names: Mapping[str, str] | None  # None: planning only
    device_type: str = "cpu"
    programs: str = "rank"  # "rank": one program per rank, this package's collectives; "global": XLA SPMD
    cfg: str = "batch"  # what a "cfg" axis divides (CFG_MODES)

    def __post_init__(self):
        if self.programs not in PROGRAMS:
            raise MeshError(f"programs={self.programs!r}: use one of {list(PROGRAMS)}")
        if self.cfg not in CFG_MODES:
            raise MeshError(f"cfg={self.cfg!r}: use one of {list(CFG_MODES)} ('batch': a cfg axis splits each call's "
                            "batch; 'pairs': its halves run a pipeline's two guidance calls at once)")
        if self.cfg == "pairs" and self.size("cfg") == 1:
            raise MeshError(f"cfg='pairs' runs a pipeline's two guidance calls on the halves of a cfg axis, and the "
                            f"mesh {self.sizes} has none of size > 1")

    @property
    def pairs_calls(self) -> bool:
        """The cfg axis runs two calls at once, one per half: the program itself is replicated over it."""
        return self.cfg == "pairs"

    @property
    def world_size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def runnable(self) -> bool:
        return self.group_names is not None

    @property
    def per_rank(self) -> bool:
        """The plan is for one program per rank, whose collectives this package inserts (not XLA's)."""
        return self.programs == "rank"

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: the mesh's device type (the current CUDA device for "cuda")."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis`` (meshes fill row-major, the last axis fastest)."""
        if axis not in self.axis_names:
            return 0
        dim = self.axis_names.index(axis)
        return self.rank // math.prod(self.axis_sizes[dim + 1:]) % self.axis_sizes[dim]

    def groups(self, axis: str) -> list[list[int]]:
        """Every process group along ``axis``, as lists of global ranks."""
        return self.joint_groups((axis,))

    def joint_groups(self, axes) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (their devices together), as lists of global ranks."""
        ranks = torch.arange(self.world_size).reshape(self.axis_sizes)
        dims = [self.axis_names.index(axis) for axis in axes]
        return ranks.movedim(dims, list(range(-len(dims), 0))).reshape(
            -1, math.prod(self.axis_sizes[d] for d in dims)).tolist()

    def group_name(self, axis: str) -> str:
        return self.group_names[axis] if self.group_names is not None else f"plan:{axis}"

    def __str__(self) -> str:
        shape = " x ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.axis_sizes))
        return f"mesh({shape}) rank {self.rank}"


def _check_axis_names(names) -> None:
    for name in names:
        if name not in KNOWN_AXES:
            raise MeshError(f"unknown mesh dim name {name!r}{did_you_mean(name, KNOWN_AXES)}: use names from "
                            f"{list(KNOWN_AXES)}")
    if len(set(names)) != len(names):
        raise MeshError(f"mesh dim names repeat: {list(names)}")
    if len([name for name in names if name in BATCH_AXES]) > 1:
        raise MeshError(f"mesh dims {list(names)} name two batch axes; use one of {list(BATCH_AXES)}")


def _check_contiguous_ulysses(spec: MeshSpec) -> MeshSpec:
    """Ulysses all-to-all groups must be runs of consecutive ranks: Neuron's all-to-all rejects strided groups
    such as [0, 2, 4, 6] at run time with an opaque error (all-reduce tolerates them), so refuse them here."""
    if "ulysses" in spec.axis_names and spec.size("ulysses") > 1:
        groups = spec.groups("ulysses")
        if any(group != list(range(group[0], group[0] + len(group))) for group in groups):
            order = tuple(name for name in spec.axis_names if name != "ulysses") + ("ulysses",)
            raise MeshError(f"the ulysses axis of mesh {spec.sizes} makes strided all-to-all groups {groups[:2]}"
                            f"{'...' if len(groups) > 2 else ''}; order the mesh dims {order} so that ulysses "
                            "is the innermost (contiguous) axis")
    return spec


def as_mesh_spec(mesh, rank: int = 0, programs: str = "rank") -> MeshSpec:
    """Normalise a DeviceMesh or a mapping of axis sizes into a ``MeshSpec`` planning ``programs``: ``"rank"``
    (one per rank, the default) or ``"global"`` (XLA SPMD's one program, on axis sizes only)."""
    from torch.distributed.device_mesh import DeviceMesh

    if programs not in PROGRAMS:
        raise MeshError(f"programs={programs!r}: use one of {list(PROGRAMS)} (\"global\" plans XLA SPMD's one "
                        "program, on axis sizes)")

    if isinstance(mesh, DeviceMesh):
        if programs != "rank":
            raise MeshError("programs='global' plans XLA SPMD's one program, which a DeviceMesh's ranks do not run: "
                            "pass the axis sizes instead, e.g. {'tp': 2}")
        names = mesh.mesh_dim_names
        if not names:
            raise MeshError(f"the DeviceMesh needs mesh_dim_names from {list(KNOWN_AXES)}, e.g. "
                            "init_device_mesh('cpu', (2,), mesh_dim_names=('tp',))")
        _check_axis_names(names)
        world = torch.distributed.get_world_size()
        if mesh.mesh.numel() != world:
            raise MeshError(f"the mesh covers {mesh.mesh.numel()} ranks ({dict(zip(names, mesh.mesh.shape))}) but "
                            f"the world has {world}: sub-meshes are not supported")
        if mesh.mesh.flatten().tolist() != list(range(world)):
            raise MeshError(f"the mesh must list ranks 0..{world - 1} in row-major order, got {mesh.mesh.tolist()}")
        return _check_contiguous_ulysses(MeshSpec(
            axis_names=tuple(names),
            axis_sizes=tuple(mesh.mesh.shape),
            rank=torch.distributed.get_rank(),
            group_names={name: mesh.get_group(name).group_name for name in names},
            device_type=mesh.device_type,
        ))
    if isinstance(mesh, Mapping):
        names = tuple(mesh)
        _check_axis_names(names)
        for name in names:
            size = mesh[name]
            if isinstance(size, bool) or not isinstance(size, int):
                raise MeshError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")
        sizes = tuple(mesh[name] for name in names)
        if any(size < 1 for size in sizes):
            raise MeshError(f"mesh axis sizes must be >= 1, got {dict(mesh)}")
        world = math.prod(sizes)
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise MeshError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < world:
            raise MeshError(f"rank {rank} is outside the mesh {dict(mesh)} of {world} ranks")
        return _check_contiguous_ulysses(MeshSpec(axis_names=names, axis_sizes=sizes, rank=rank, group_names=None,
                                                  programs=programs))
    raise MeshError(f"mesh must be a DeviceMesh or a mapping of axis sizes such as {{'tp': 2}}, got {type(mesh).__name__}")
