# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs, makes the demo data and trains the CPU demo to its target
#   make test   creates .venv, installs, runs the whole test suite (the mypy check is one of its tests)
#   make gpu-check  on a GPU machine: the fake-CUDA dry run of every shipped config, run for real
#   make mutants    plants each bug of the mutant list (tools/mlperf_tools/testing/mutant_list.py) and runs its tests (docs/TESTING.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; on a GPU machine use the NGC container (see Dockerfile) instead.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The tests also need transformers, mpi4py, matplotlib and TensorFlow (checkpoint conversion).
# Both install torchao (the fp8 extra): `PRECISION=fp8 make demo` and the fp8 tests need it.
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=
# Test files run side by side in pytest-xdist workers, one per CPU and at most 4 (a test may start
# several trainer processes of its own); a file's tests stay on one worker, so its module-scoped
# set-up runs once. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

.PHONY: demo test venv clean-demo gpu-check mutants

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[prep,fp8]'
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,prep,tf,fp8]'
	touch $@

venv: $(STAMP)

# Quoted, not $(abspath): make splits a path with spaces into words.
demo: $(STAMP)
	PYTHON="$(CURDIR)/$(PY)" bash tools/run_demo.sh

test: $(TEST_STAMP)
	bash tools/install_test_tools.sh
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# Mutation testing of the newest modules; MUTANT_ARGS="--module sharded" or "--only ID" narrows it.
MUTANT_ARGS ?=
mutants: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(PY) tools/mutants.py $(MUTANT_ARGS)

# The same steps the test suite dry-runs on fake CUDA, on this machine's GPU (tools/gpu_check.sh).
gpu-check:
	PYTHON=$${PYTHON_GPU:-python3} bash tools/gpu_check.sh

clean-demo:
	rm -rf demo_data demo_runs

# One command on a new machine (tools/bring_up.sh, docs/BRING_UP.md): the GPU tests, the numerics check
# in every precision the device supports, make gpu-check per config with its peak memory, and the
# throughput benchmark; results and summary.txt in BRING_UP_OUT (default $OUT, else bring_up_out/).
.PHONY: bring-up carry gpu-perf
BRING_UP_OUT ?= $(if $(OUT),$(OUT),bring_up_out)
bring-up:
	PYTHON=$${PYTHON_GPU:-python3} bash tools/bring_up.sh "$(BRING_UP_OUT)"

# The prepared GPU measurement (tools/gpu_perf.sh, docs/PERFORMANCE.md): the shipped config of this GPU,
# its variants, packed against HuggingFace, and the trainer itself, in 8 minutes; one summary.txt.
GPU_PERF_OUT ?= $(if $(OUT),$(OUT),gpu_perf_out)
gpu-perf:
	PYTHON=$${PYTHON_GPU:-python3} bash tools/gpu_perf.sh "$(GPU_PERF_OUT)"

# The wheels bring-up installs offline (pip install --no-index), for a device machine's Python
# (CARRY_PYTHON: 3.12, x86-64 Linux) that has torch and no package registry: torchao for --precision
# fp8 (0.18 loads on torch >= 2.11), mlperf-logging (the trainer's MLPerf log) and crc32c (data_prep,
# which the GPU tests' packed data comes from). What the machine's image holds is tools/device_image.txt;
# tests/tools/bring_up/test_image_imports.py fails on an import of the bring-up's that is in neither. flash-attn is not
# carried: the registry has no wheel of it (a source build needs nvcc and about an hour); on torch >= 2.9
# --attention_backend varlen runs PyTorch's own kernel instead.
CARRY_DIR := carry/wheels
CARRY_PYTHON ?= 3.12
CARRY_WHEELS ?= torchao==0.18.0 mlperf-logging==4.1.68 crc32c==2.9.post0
carry:
	mkdir -p $(CARRY_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(CARRY_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(CARRY_DIR) $(CARRY_WHEELS)
	du -sh $(CARRY_DIR)
