"""Helpers for examples, tests and benchmarks: small models (``models``), local ranks (``ranks``) and measured
memory (``memory``)."""

from . import memory, models, ranks
from .memory import *  # noqa: F403
from .models import *  # noqa: F403  (the names listed in models.__all__)
from .ranks import *  # noqa: F403  (the names listed in ranks.__all__)

__all__ = [*memory.__all__, *models.__all__, *ranks.__all__]
