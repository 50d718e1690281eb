# The two commands a newcomer needs: `make run` and `make test` (each sets up .venv on first use).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny
CONFIG ?= configs/tiny.py
ARGS ?=
PYTEST_ARGS ?=

export PYTHONPATH := $(CURDIR)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TF_CPP_MIN_LOG_LEVEL := 2

VLLM_VENV := .venv-vllm

# An NVIDIA GPU (`nvidia-smi -L` lists one) selects the CUDA builds: JAX's CUDA plugin and the GPU
# vLLM. `make -n run` shows the choice without installing anything.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(GPU),1)
REQUIREMENTS := requirements-gpu.txt
VLLM_REQUIREMENTS := requirements-vllm-gpu.txt
PLATFORM := an NVIDIA GPU (nvidia-smi -L)
else
REQUIREMENTS := requirements.txt
VLLM_REQUIREMENTS := requirements-vllm.txt
PLATFORM := no NVIDIA GPU: CPU builds
endif

.PHONY: run test lint bench gpu-check vllm-env clean-venv

$(VENV)/.runtime: $(REQUIREMENTS) requirements.txt
	@echo "jaxrl: $(PLATFORM): installing $(REQUIREMENTS) into $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	touch $@

$(VENV)/.dev: requirements-dev.txt $(VENV)/.runtime
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# The vLLM sidecar's own environment (docs/sidecar.md). On CPU, PyPI's
# torchvision/torchaudio/torchcodec are CUDA builds that break transformers' model imports: removed.
$(VLLM_VENV)/.stamp: $(VLLM_REQUIREMENTS)
	@echo "jaxrl: $(PLATFORM): installing $(VLLM_REQUIREMENTS) into $(VLLM_VENV)"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQUIREMENTS)
ifneq ($(GPU),1)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $@

vllm-env: $(VLLM_VENV)/.stamp

run: $(VENV)/.runtime
	$(PY) -m jaxrl.main --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

# Two workers (the machines have 2 cores; most tests are single-threaded compiles), one test file
# per worker at a time so module fixtures (the shared vLLM server) start once.
TEST_WORKERS ?= 2
# `make test`: every test not marked slow. `make test SLOW=1`: all of them, as CI runs them
# (.ci/run): the vLLM sidecar against a real server, multi-process runs, kills and resumes.
SLOW ?= 0
ifeq ($(SLOW),1)
TEST_ENVS := $(VENV)/.dev $(VLLM_VENV)/.stamp
TEST_MARKS :=
else
TEST_ENVS := $(VENV)/.dev
TEST_MARKS := -m "not slow"
endif

# Style is enforced: the formatter's output, pyflakes/pycodestyle, import order and a complexity
# limit (pyproject.toml). `make test` runs it first.
lint: $(VENV)/.dev
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

test: $(TEST_ENVS) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 $(TEST_MARKS) $(PYTEST_ARGS)

bench: $(VENV)/.dev
	$(PY) bench/fused_logprob.py
	$(PY) bench/allocators.py
	$(PY) bench/train_step_vs_torch.py --out bench/results/peers.jsonl
	$(PY) bench/sampler_vs_hf.py --out bench/results/peers.jsonl
	$(PY) bench/sampler_vs_hf.py --vocab 151936 --repeats 3 --out bench/results/peers.jsonl
	$(PY) bench/decode_step.py --out bench/results/decode_step.jsonl

# On a GPU host, with the Python that has its JAX (no venv is built): `make gpu-check PY=python3`,
# then `make gpu-check PY=python3 ARGS="--stages 6"` (bench/gpu_check.py says what each stage measures).
gpu-check:
	$(PY) bench/gpu_check.py $(ARGS)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
