"""partitioner: a compiler-pass based model partitioner for PyTorch."""

from .api import Partitioned, partition
from .checkpoint import CheckpointError
from .mesh import MeshError
from .placement import PackedShard
from .rules import PartitionError
from .runtime import InputError
from .trace import TraceError

__all__ = ["CheckpointError", "InputError", "MeshError", "PackedShard", "PartitionError", "Partitioned", "TraceError", "partition"]
