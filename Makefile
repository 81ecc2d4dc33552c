# One-command entry points. Each does its own set-up into .venv/ on a fresh machine with Python 3.11.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dstk-installed

.PHONY: demo test test-unit bench setup presets clean

setup: $(STAMP)

# Order matters: torch first (the CPU wheel on disk; a bare "torch" pulls CUDA), then deepspeed
# without build isolation (its setup.py imports torch), then dstk itself with its test extras.
$(STAMP): setup.cfg pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.19,<0.20"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m toolkit.train.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python bench/run_all.py --quick

clean:
	rm -rf $(VENV) build *.egg-info

presets: $(STAMP)
	$(BIN)/python -m toolkit.config.presets
