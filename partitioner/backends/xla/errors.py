"""The XLA backend's errors, in a module of their own so that every part of the backend raises the same classes.
Both are ``BackendError``s; ``CollectiveMismatch`` is also an ``AssertionError``: XLA's partitioned HLO failed the
check against the plan."""

from ...errors import BackendError


class XlaBackendError(BackendError):
    pass


class CollectiveMismatch(BackendError, AssertionError):
    pass
