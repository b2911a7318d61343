# Entry points that work on a fresh machine with only Python 3.11+:
#   make           set up .venv and say how to put `tray` on PATH
#   make demo      set up .venv, run a 4-rank tray (host backend when no GPU is visible): the peer-barrier gate
#   make test      set up .venv, run the test suite (GPU tests skip when no GPU is visible; runs the examples)
#   make examples  run every example in examples/ on the host backend, as its docstring says
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.DEFAULT_GOAL := setup
.PHONY: setup demo test examples lint gpu-wheels gpu-install clean

setup: $(BIN)/.installed
	@echo "tray is installed in $(VENV). Put it on PATH with:  . $(BIN)/activate"
	@echo "(or call $(BIN)/tray and $(BIN)/python directly). Next: make demo, make examples, make test"

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# NOTE: the torch extra (a CPU build) runs the interop tests; 36 s and 0.9 GB to install here (2026-11-30)
	$(BIN)/pip install -q -e '.[test,torch]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/tray gate peer-barrier -n 4 --iters 200
	$(BIN)/tray gate peer-barrier -n 4 --drop 2 --timeout-s 1

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

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
	rm -rf $(VENV) build *.egg-info
