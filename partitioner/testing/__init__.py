"""Helpers for examples, tests and benchmarks: small models (``models``), local ranks (``ranks``), measured
memory (``memory``) and negative controls (``controls``)."""

from . import controls, memory, models, ranks
from .controls import *  # noqa: F403
from .memory import *  # noqa: F403
from .models import *  # noqa: F403  (the names listed in models.__all__)
from .ranks import *  # noqa: F403  (the names listed in ranks.__all__)

__all__ = [*controls.__all__, *memory.__all__, *models.__all__, *ranks.__all__]
