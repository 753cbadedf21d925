"""The runnable Python blocks of the docs (fenced ```python, not ```python no-run), shared by tests/test_docs.py and
the installed-wheel check (tests/wheel/check_installed.py), which has no pytest."""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.S | re.M)

# Prepended to every block: a PartitionWarning (an axis that shards nothing, a fallback) fails the block.
WARNINGS_AS_ERRORS = ("import warnings\nfrom partitioner.errors import PartitionWarning\n"
                      "warnings.simplefilter('error', PartitionWarning)\n")


def runnable_blocks(page: Path):
    """(line, code) of each runnable block of ``page``."""
    text = page.read_text()
    for match in FENCE.finditer(text):
        info = match.group("info").split()
        if info[:1] == ["python"] and "no-run" not in info:
            yield text[: match.start()].count("\n") + 1, match.group("body")
