"""partitioner: a compiler-pass based model partitioner for PyTorch."""

from .api import Partitioned, partition
from .mesh import MeshError
from .placement import PackedShard
from .rules import PartitionError
from .runtime import InputError
from .trace import TraceError

__all__ = ["InputError", "MeshError", "PackedShard", "PartitionError", "Partitioned", "TraceError", "partition"]
