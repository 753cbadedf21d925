"""XLA SPMD tests: run in the torch_xla virtual environment (``make test`` creates it), one process driving four
virtual CPU devices. XLA reads its environment once, when its runtime starts, so it is set here first."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

try:
    import torch_xla  # noqa: F401
except ImportError as error:  # fail loudly: these tests are never to be skipped
    raise ImportError("tests/xla need torch_xla: run them with .venv-xla/bin/python (make test creates it)") from error
