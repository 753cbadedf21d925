"""Helpers for examples, tests and benchmarks: small models (``models``) and local ranks (``ranks``)."""

from . import models, ranks
from .models import *  # noqa: F403  (the names listed in models.__all__)
from .ranks import *  # noqa: F403  (the names listed in ranks.__all__)

__all__ = [*models.__all__, *ranks.__all__]
