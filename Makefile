# `make demo` and `make test` each create .venv on first use, then run.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned first so pip takes the CPU build (a later, unpinned resolve would pull a CUDA build).
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: demo test
demo: $(VENV)/.installed
	$(PY) examples/h3_tensor_parallel.py
	$(PY) examples/h3_tp_ulysses.py

test: $(VENV)/.installed
	$(PY) -m pytest -q tests
