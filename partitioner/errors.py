"""Every error the package raises on purpose derives from ``PartitionerError``.

Each subclass also derives from the builtin that callers caught before it existed (``ValueError`` for bad input,
``RuntimeError`` for failures while running), so ``except ValueError`` keeps working. Messages name the module,
input, dimension or degree at fault and end with what to do.
"""

from __future__ import annotations

import contextlib
import difflib


class PartitionerError(Exception):
    """Base of every error raised on purpose by partitioner."""


def did_you_mean(name: str, valid) -> str:
    """``"; did you mean 'tp'?"`` for the valid names closest to a misspelt ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


class TraceError(PartitionerError, RuntimeError):
    """torch.export could not trace the model, or the model is outside what partition supports."""


class MeshError(PartitionerError, ValueError):
    """The mesh is malformed: unknown dim names, bad sizes, strided groups, a rank outside it."""


class InvariantError(PartitionerError, AssertionError):
    """A pass broke its own postcondition: a bug in partitioner. The dumps (``dump_dir``) show the graph."""


class PartitionError(PartitionerError, ValueError):
    """The requested partition is impossible (e.g. a TP degree that does not divide a head count)."""


class DataDependentNumber(PartitionError):
    """A number computed from tensor values sizes device ops (or data-dependent code reads a model tensor), so the
    host prologue cannot take it: ``partition`` traces the model again specialised on its inputs' values, when it
    has any."""


class InputError(PartitionerError, ValueError):
    """Bad arguments: a call's inputs that do not fit the partition (shape, dtype, structure, index range,
    data-dependent size), or options that are not understood."""


class NotFound(PartitionerError, KeyError, AttributeError):
    """A name (module path, tensor, backend, attribute) that the partition does not have."""


class CheckpointError(PartitionerError, ValueError):
    """A checkpoint misses tensors, has other shapes or dtypes, or cannot be read."""


class MissingWeights(CheckpointError, RuntimeError):
    """The partition would run on meta tensors: the model had no weights and no checkpoint was loaded."""


class BackendError(PartitionerError, RuntimeError):
    """A backend cannot lower or run this partition (missing package, unsupported graph)."""


class RankDisagreement(PartitionerError, RuntimeError):
    """Ranks built different plans, or called the partition differently; raised on every rank."""


class FailedOnAnotherRank(RankDisagreement):
    """``partition`` failed on another rank (its error named here), so this rank refuses too: every rank raises,
    the failing one its own error, so that every rank can fall back alike (a VAE decodes whole)."""


class CollectiveTimeout(PartitionerError, RuntimeError):
    """A collective did not complete within the partition's timeout (a peer failed, hung or never called)."""


class PartitionUnusable(PartitionerError, RuntimeError):
    """An earlier call failed after its first collective: the ranks' message streams may be out of step."""


class AlreadyPartitioned(PartitionerError, RuntimeError):
    """An operation that changes the weights or structure of a model already partitioned, or needs its whole weights
    (fusing projections, loading or switching LoRA adapters, ``to(dtype)``, another device, ``state_dict``, saving
    it), asked of the module ``parallelize`` installs after its first call: apply it before ``parallelize``."""


class BackwardUnsupported(PartitionerError, RuntimeError):
    """``backward`` through a partitioned program: its gradients would not be the model's (a collective's backward
    sums again, a rank's slice never gathers its gradient), so it is refused until they are."""


class ConcurrentCall(PartitionerError, RuntimeError):
    """A second thread called a partition of a mesh while another call on that mesh ran: the ranks could pair
    their threads' collectives crosswise."""


class PartitionWarning(UserWarning):
    """A plan that is exact but wastes a mesh axis (e.g. a sequence degree that shards no attention)."""


class VerificationError(PartitionerError, AssertionError):
    """``Partitioned.verify`` found a value that differs from the unpartitioned model."""


# ---- a failure inside our own steps, named where it happened ----

def where_it_failed(error: BaseException) -> str:
    """The graph node the innermost frame of ``error``'s traceback was working on (a local that is an fx Node),
    with its op and the model's source line: '' when no frame held one."""
    from torch.fx import Node

    from .source import source_line  # (torch.fx on demand: errors is imported first)

    node, tb = None, error.__traceback__
    while tb is not None:
        candidates = [v for v in tb.tb_frame.f_locals.values() if isinstance(v, Node)]
        local = tb.tb_frame.f_locals.get("node")
        node = local if isinstance(local, Node) else candidates[0] if candidates else node
        tb = tb.tb_next
    if node is None:
        return ""
    op = getattr(node.target, "__name__", str(node.target))
    return f" at {node.name} ({op}, from {source_line(node)})"


@contextlib.contextmanager
def our_step(step: str, error_type=None):
    """A failure inside one of our own steps (a pass, a trace clean-up, a backend's lowering) is a bug of ours or a
    graph it cannot take, never a raw builtin from deep inside: ``error_type`` (default ``InvariantError``) naming
    the step, the node it was on, its op and the model's source line. Errors raised on purpose pass through."""
    try:
        yield
    except PartitionerError:
        raise
    except Exception as error:
        message = f"{step} failed{where_it_failed(error)}: {type(error).__name__}: {str(error)[:500]}"
        if error_type is None:
            raise InvariantError(f"{message}. This is a bug in partitioner; the graph before the pass is dumped with "
                                 "partition(..., dump_dir=...)") from error
        raise error_type(message) from error
