"""This rank's shards of the model's tensors, cut as the slicing specs of ``localize`` say."""

from __future__ import annotations

import torch

from ..mesh import MeshSpec
from ..placement import slice_local


def shard_tensor(tensor: torch.Tensor, spec: dict, mesh: MeshSpec) -> torch.Tensor:
    """Cut ``tensor`` by ``spec`` ({axis: placement}) for this rank, detached (the weights a partition trains are
    made parameters of their own, ``Partitioned.train_weights``)."""
    tensor = tensor.detach()
    for axis in mesh.axis_names:  # outer axes first, as local_shape
        if axis in spec:
            tensor = slice_local(tensor, spec[axis], mesh.size(axis), mesh.coordinate(axis))
    return tensor


def shard_state(state: dict[str, torch.Tensor], names, slice_specs: dict[str, dict], mesh: MeshSpec):
    """Local tensors for the graph's parameter/buffer/constant inputs ``names`` (FQNs)."""
    return {name: shard_tensor(state[name], slice_specs.get(name, {}), mesh) for name in names}
