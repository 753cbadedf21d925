"""Run by tests/wheel/smoke.sh with the installed wheel's interpreter, outside the checkout: the package is the
installed one, its data files are there, the README's example runs with no PartitionWarning, the CLI works."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

readme = Path(sys.argv[1])
sys.path.insert(0, str(readme.parent / "tests"))  # docs_blocks only: the checkout's package stays out of reach
from docs_blocks import WARNINGS_AS_ERRORS, runnable_blocks  # noqa: E402

import partitioner  # noqa: E402
from partitioner.planning import cost  # noqa: E402

site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert Path(partitioner.__file__).resolve().is_relative_to(site), f"imported {partitioner.__file__}, not the wheel's"
for name in ("cpu-gloo", "trn2", "h100-nvlink", "h200-nvlink"):
    cost.load_profile(name)  # the profiles are package data: a wheel without them fails report()

for line, code in runnable_blocks(readme):
    result = subprocess.run([sys.executable, "-c", WARNINGS_AS_ERRORS + code], capture_output=True, text=True)
    assert result.returncode == 0, f"README.md:{line} fails:\n{result.stderr[-3000:]}"
    print(f"README.md:{line} runs")

for command in (["report", "--model", "minimax-h3", "--mesh", "tp=8", "--seq-len", "4096"],
                ["plan", "--model", "FluxTransformer2DModel", "--config", "num_layers=1", "--config",
                 "num_single_layers=1", "--mesh", "tp=2,ulysses=2"]):
    result = subprocess.run([sys.executable, "-m", "partitioner", *command], capture_output=True, text=True)
    assert result.returncode == 0 and "PartitionWarning" not in result.stderr, result.stderr[-3000:]
    print("python -m partitioner", " ".join(command), "runs")
print("the installed wheel works")
