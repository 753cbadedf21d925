"""Every runnable Python block of README.md and docs/ runs (each in a fresh interpreter, from the repository root);
blocks marked ``python no-run`` need several ranks, a GPU or downloaded weights. The links between the pages
point at files that exist."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import partitioner

from docs_blocks import WARNINGS_AS_ERRORS, runnable_blocks

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks():
    for page in PAGES:
        for line, code in runnable_blocks(page):
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_runnable_block_runs(code):
    """Each block runs clean: an error or a PartitionWarning (an axis that shards nothing) fails it."""
    result = subprocess.run([sys.executable, "-c", WARNINGS_AS_ERRORS + code], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_there_are_runnable_blocks():
    assert len(list(_blocks())) >= 2  # the README's ten lines and docs/api.md's first example


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files_that_exist(page):
    for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


# A signature written in a bullet of the API page: `- `partition(model, mesh, *, plan=None) -> Partitioned``.
SIGNATURE = re.compile(r"^- `(?P<name>[\w.]+)\((?P<params>[^`]*)\)(?: -> [^`]+)?`", re.M)


def _written_signatures():
    text = (ROOT / "docs" / "api.md").read_text()
    for match in SIGNATURE.finditer(text):
        yield pytest.param(match.group("name"), " ".join(match.group("params").split()), id=match.group("name"))


def _documented(name: str):
    owner, _, attribute = name.removeprefix("partitioner.").rpartition(".")
    return getattr(getattr(partitioner, owner) if owner else partitioner, attribute)


@pytest.mark.parametrize("name,params", list(_written_signatures()))
def test_signatures_written_in_the_api_page_are_the_code_s(name, params):
    """Every parameter the page writes exists with the default it writes; a signature without ``...`` lists every
    parameter the code has, in order."""
    actual = inspect.signature(_documented(name)).parameters
    written = [p.strip() for p in re.split(r",(?![^\[{(]*[\]})])", params) if p.strip() not in ("", "*")]
    names = []
    for param in written:
        if param == "...":
            continue
        key, _, default = param.partition("=")
        key = key.lstrip("*")
        names.append(key)
        assert key in actual, f"docs/api.md writes {name}({key}=...), which the code does not take"
        if default and "|" not in default:
            assert ast.literal_eval(default) == actual[key].default, \
                f"docs/api.md writes {name}({key}={default}), the code's default is {actual[key].default!r}"
    if "..." not in written:
        code = [key for key in actual if key != "self"]
        assert names == code, f"docs/api.md writes {name}({', '.join(names)}), the code has ({', '.join(code)})"


def test_the_api_page_writes_the_main_signatures():
    assert {param.values[0] for param in _written_signatures()} >= {"partition", "partitioner.plan"}
