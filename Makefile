# Entry points that work on a fresh machine with only Python 3.11+:
#   make           set up .venv and say how to put `tray` on PATH
#   make demo      set up .venv, run a 4-rank tray (host backend when no GPU is visible): the peer-barrier gate
#   make test      set up .venv, run the test suite (GPU tests skip when no GPU is visible; runs the examples)
#   make examples  run every example in examples/ on the host backend, as its docstring says
#   make test-lowest  the test suite against the oldest releases pyproject.toml allows, in .venv-lowest
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.DEFAULT_GOAL := setup
.PHONY: setup demo test test-lowest examples lint gpu-wheels gpu-install clean

setup: $(BIN)/.installed
	@echo "tray is installed in $(VENV). Put it on PATH with:  . $(BIN)/activate"
	@echo "(or call $(BIN)/tray and $(BIN)/python directly). Next: make demo, make examples, make test"

# NOTE: torch runs the interop tests only (`make test`): a CPU build from PyTorch's own index, 754 MB installed
# (torch 2.13.0+cpu, 2026-12-01). Where that index cannot be reached, pip takes what its other indexes offer, on
# Linux x86-64 a CUDA build with its nvidia-* libraries (5.5 GB, torch 2.14.1, same day); TORCH_INDEX= to skip it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(BIN)/.torch: $(BIN)/.installed
	$(BIN)/pip install -q --retries 1 --timeout 20 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e '.[torch]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/tray gate peer-barrier -n 4 --iters 200
	$(BIN)/tray gate peer-barrier -n 4 --drop 2 --timeout-s 1

# TESTS: what pytest runs (`make test TESTS="tests/unit -k wire"`; the whole suite by default)
TESTS ?= tests
# TEST_JOBS: test files run side by side, one per CPU by default (a tray's ranks spend much of a test waiting:
# a test file alone kept about one of 2 cores busy); TEST_JOBS=0 runs them one after another in this process, the
# default where nvidia-smi lists a GPU (each GPU test takes every GPU it sees)
TEST_JOBS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 0 || echo auto)

# tray's modules compiled first: every rank a test starts loads them, and with PYTHONDONTWRITEBYTECODE set each
# process would compile them again (about 0.25 s of CPU per process here)
test: $(BIN)/.installed $(BIN)/.torch
	$(BIN)/python -m compileall -q tray
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(TESTS)

# The lower bounds of pyproject.toml kept true: uv's lowest-direct resolution installs the oldest release each direct
# dependency's range allows (their own dependencies at their newest), then the suite runs there as `make test` runs it.
# torch is taken as `make test` takes it, not at its lowest (2.4 has no CPU build on PyPI: its CUDA build and nvidia-*
# libraries made a 5.1 GB venv): LOWEST_TORCH names what pip installs (`LOWEST_TORCH=torch==2.4.0` the lowest,
# `torch==2.13.0` a CPU build on disk, empty: none, the interop tests skip). The interop tests at 2.4.0:
# bench/results/host/compat/torch_2.4.0_3464b6e.log.
# Bytecode is compiled at install (uv does not by default): with PYTHONDONTWRITEBYTECODE set, every rank compiled
# numpy's modules again and its start took over the 3 s some tests allow. pyzmq, ml_dtypes and safetensors come as
# wheels only: their lowest have wheels for 3.11, and on a newer Python the lowest release with one is taken (their
# sdists of then do not build there: pyzmq 25.0 on 3.12, ml_dtypes 0.4.0 and safetensors 0.4.0 on 3.13); psutil 5.9.0
# builds from source. Not run by .ci/run: a fresh venv and a
# second whole suite (2 cores: about 90 s to install, then the suite's time again).
LOWEST_VENV ?= .venv-lowest
LOWEST_TORCH ?= -e '.[torch]'
test-lowest: $(BIN)/.installed
	$(BIN)/pip install -q uv
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(BIN)/uv pip install -q --python $(LOWEST_VENV)/bin/python --resolution lowest-direct --compile-bytecode \
		--only-binary pyzmq --only-binary ml-dtypes --only-binary safetensors -e '.[test]'
	$(if $(LOWEST_TORCH),$(LOWEST_VENV)/bin/pip install -q --retries 1 --timeout 20 \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(LOWEST_TORCH))
	$(LOWEST_VENV)/bin/pip list
	$(LOWEST_VENV)/bin/python -m compileall -q tray
	$(LOWEST_VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(TESTS)

examples: $(BIN)/.installed
	$(BIN)/python examples/run_all.py

lint: $(BIN)/.installed
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check tray tests bench examples
	$(BIN)/mypy

# GPU machine without network: download the wheels here, install them there.
gpu-wheels:
	scripts/gpu-wheels.sh download

gpu-install:
	scripts/gpu-wheels.sh install

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info
