#!/usr/bin/env bash
# The package as a user gets it: build the wheel, install it into a fresh virtual environment outside the checkout,
# and run the README's example and the command line there (`make test-wheel`; part of `make test`).
# Usage: tests/wheel/smoke.sh PYTHON TORCH_SPEC
set -euo pipefail
PYTHON=${1:-python3.11}
TORCH_SPEC=${2:-torch==2.13.0}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/partitioner-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

"$ROOT/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT"
rm -rf "$ROOT/build"  # (setuptools builds in the tree)
"$PYTHON" -m venv "$WORK/env"
"$WORK/env/bin/python" -m pip install -q "$TORCH_SPEC"
"$WORK/env/bin/python" -m pip install -q "$WORK"/dist/partitioner-*.whl
cd "$WORK"  # nothing of the checkout is importable from here
"$WORK/env/bin/python" "$ROOT/tests/wheel/check_installed.py" "$ROOT/README.md"
