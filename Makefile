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
	$(PY) -m pip install -q -e ".[test,quant]"
	touch $@

# XLA SPMD: torch_xla's last release needs exactly torch 2.9.0 (a CUDA build, ~7 GB), so it has its own venv.
XLA_VENV := .venv-xla
XLA_PY := $(XLA_VENV)/bin/python

$(XLA_VENV)/.installed: pyproject.toml Makefile
	test -x $(XLA_PY) || $(PYTHON) -m venv $(XLA_VENV) || python3 -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install -q --upgrade pip
	$(XLA_PY) -m pip install -q torch==2.9.0 torch_xla==2.9.0
	$(XLA_PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: demo demo-xla test test-fast test-wheel
demo: $(VENV)/.installed
	$(PY) examples/h3_tensor_parallel.py
	$(PY) examples/h3_tp_ulysses.py
	$(PY) examples/h3_pipeline.py
	$(PY) examples/flux_pipeline.py --tp 2 --ulysses 2

demo-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 $(XLA_PY) examples/h3_xla_spmd.py

# The whole suite on the newest torch, then on torch 2.9 the XLA SPMD tests (4 virtual CPU devices) and a
# compatibility subset that runs programs end to end: TP numerics, the denoise step's host prologue under TP and
# TP x Ulysses, checkpoints, bad input, the rank agreement (process groups, timeouts, tracebacks), and a plan saved
# under torch 2.13 applied to a torch 2.9 trace.
COMPAT := tests/xla tests/test_tp_numerics.py tests/test_hoist_host.py tests/test_checkpoint.py \
	tests/test_bad_input.py tests/test_rank_agreement.py tests/test_saved_plans.py
test: $(VENV)/.installed $(XLA_VENV)/.installed test-wheel
	$(PY) -m pytest -q tests --ignore=tests/xla
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 $(XLA_PY) -m pytest -q $(COMPAT)

# The package as a user installs it: the wheel in a fresh venv outside the checkout runs the README's example and the
# command line (about a minute).
test-wheel: $(VENV)/.installed
	bash tests/wheel/smoke.sh $(PYTHON) "$(TORCH_SPEC)"

# The edit loop: the tests not marked slow (tests/conftest.py), every file represented: 6 minutes on 2 cores.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" tests --ignore=tests/xla
