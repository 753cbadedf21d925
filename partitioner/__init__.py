"""partitioner: a compiler-pass based model partitioner for PyTorch."""

from .api import Partitioned, partition
from .backends.neuron import NeuronLegalityError
from .backends.xla import CollectiveMismatch, XlaBackendError
from .checkpoint import CheckpointError
from .mesh import MeshError
from .placement import PackedShard
from .rules import PartitionError
from .runtime import InputError
from .trace import TraceError

__all__ = ["CheckpointError", "CollectiveMismatch", "InputError", "MeshError", "NeuronLegalityError", "PackedShard",
           "PartitionError", "Partitioned", "TraceError", "XlaBackendError", "partition"]
