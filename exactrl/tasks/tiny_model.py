"""A tiny Llama-architecture causal LM, initialised from scratch and saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from exactrl.tasks.tokenizer import VOCAB_SIZE

if TYPE_CHECKING:  # imported where used: the config's help states the sizes (parameters()) without them
    from transformers import LlamaForCausalLM

# Small enough to train SFT-then-RL in minutes on two CPU cores, large enough to learn column addition.
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=384)
# Two layers: it learns the worked column addition in fewer steps than TINY
# (measured: 42% greedy after 400 SFT steps of 32 against TINY's 11%) at twice its step rate, which is
# what lets a study give every mixed-policy method as many demonstrations as SFT sees.
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=192)
SIZES = {"tiny": TINY, "small": SMALL}


def parameters(size: str) -> int:
    """The built-in model ``size``'s parameter count, from its shapes: a Llama with the tied embedding of the
    built-in tokenizer, attention and MLP without biases, two RMS norms a layer and one at the end (what `help` and
    the docs say; tests/test_tasks.py holds it to the built model's count, which a run's metrics record)."""
    d = SIZES[size]
    h, kv = d["hidden_size"], d["hidden_size"] // d["num_attention_heads"] * d["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * d["intermediate_size"] + 2 * h  # q, o; k, v; gate, up, down; norms
    return VOCAB_SIZE * h + d["num_hidden_layers"] * layer + h


def build_tiny_model(vocab_size: int, pad_id: int, bos_id: int, eos_id: int, seed: int = 0,
                     **overrides) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **{**TINY, **overrides},
    )
    # Its own seed, and the caller's random state untouched: a run that builds the built-in model on
    # first use must draw what a run that finds it cached draws.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def save_tiny_model(path: str | Path, tokenizer, seed: int = 0, **overrides) -> None:
    model = build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                             seed, **overrides)
    model.save_pretrained(str(path))
