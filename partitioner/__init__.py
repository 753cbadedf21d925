"""partitioner: a compiler-pass based model partitioner for PyTorch."""

from .api import Partitioned, partition
from .backends.neuron import NeuronLegalityError, NeuronPerformanceWarning
from .backends.xla import CollectiveMismatch, XlaBackendError
from .errors import (AlreadyPartitioned, BackendError, CheckpointError, CollectiveTimeout, InputError, MeshError, MissingWeights,
                     NotFound, PartitionError, PartitionerError, PartitionUnusable, PartitionWarning,
                     RankDisagreement, TraceError, VerificationError)
from .pipelines import parallelize
from .placement import PackedShard
from .plans import Plan, plan

__all__ = ["AlreadyPartitioned", "BackendError", "CheckpointError", "CollectiveMismatch", "CollectiveTimeout", "InputError", "MeshError",
           "MissingWeights", "NeuronLegalityError", "NeuronPerformanceWarning", "NotFound", "PackedShard",
           "PartitionError", "PartitionUnusable",
           "PartitionWarning", "Partitioned", "PartitionerError", "Plan", "RankDisagreement", "TraceError",
           "VerificationError", "XlaBackendError", "parallelize", "partition", "plan"]
