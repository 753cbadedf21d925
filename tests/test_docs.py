"""Every runnable Python block of README.md and docs/ runs (each in a fresh interpreter, from the repository root);
blocks marked ``python no-run`` need several ranks, a GPU or downloaded weights. The links between the pages
point at files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.S | re.M)


def _blocks():
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            info = match.group("info").split()
            if info[:1] == ["python"] and "no-run" not in info:
                line = page.read_text()[: match.start()].count("\n") + 1
                yield pytest.param(match.group("body"), id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_runnable_block_runs(code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_there_are_runnable_blocks():
    assert len(list(_blocks())) >= 2  # the README's ten lines and docs/api.md's first example


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files_that_exist(page):
    for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
