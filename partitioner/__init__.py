"""partitioner: a compiler-pass based model partitioner for PyTorch."""

from .api import Partitioned, partition, plan
from .backends.neuron import NeuronLegalityError, NeuronPerformanceWarning
from .backends.xla import CollectiveMismatch, XlaBackendError
from .errors import (AlreadyPartitioned, BackendError, BackwardUnsupported, CheckpointError, CollectiveTimeout,
                     ConcurrentCall, FailedOnAnotherRank, InputError, MeshError,
                     MissingWeights, NotFound, PartitionerError, PartitionError, PartitionUnusable, PartitionWarning,
                     RankDisagreement, TraceError, VerificationError)
from .placement import PackedShard
from .plans import Plan
from .runtime.pipelines import parallelize

__all__ = ["AlreadyPartitioned", "BackendError", "BackwardUnsupported", "CheckpointError", "CollectiveMismatch",
           "CollectiveTimeout", "ConcurrentCall", "FailedOnAnotherRank", "InputError", "MeshError",
           "MissingWeights", "NeuronLegalityError", "NeuronPerformanceWarning", "NotFound", "PackedShard",
           "PartitionError", "PartitionUnusable",
           "PartitionWarning", "Partitioned", "PartitionerError", "Plan", "RankDisagreement", "TraceError",
           "VerificationError", "XlaBackendError", "parallelize", "partition", "plan"]
