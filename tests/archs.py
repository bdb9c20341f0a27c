"""Tiny randomly initialised decoders of many Hugging Face architectures, built from
transformers' own config classes, for the architecture matrix (tests/test_arch_matrix.py).

Each is small enough for a forward in milliseconds, yet keeps what makes its family differ:
sliding windows narrower than the test sequences, Gemma2's attention-logit softcapping,
ALiBi (Bloom, Falcon), multi-query attention (GPT-BigCode), dropout left on as the family's
configs ship it (GPT-2, OPT, GPT-BigCode), mixture-of-experts (Qwen3-MoE)."""

from __future__ import annotations

import torch
import transformers

VOCAB, WINDOW = 103, 8  # the built-in character tokenizer's vocabulary
CORE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LLAMA_LIKE = dict(CORE, num_key_value_heads=2)
GPT2_LIKE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)

# name -> (config class, kwargs)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", LLAMA_LIKE),
    "qwen2": ("Qwen2Config", LLAMA_LIKE),
    "qwen3": ("Qwen3Config", dict(LLAMA_LIKE, head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(LLAMA_LIKE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=1)),
    "mistral": ("MistralConfig", dict(LLAMA_LIKE, sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=8)),
    "gemma3": ("Gemma3TextConfig", dict(LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(LLAMA_LIKE, sliding_window=WINDOW)),
    "starcoder2": ("Starcoder2Config", dict(LLAMA_LIKE, sliding_window=WINDOW)),
    "phi": ("PhiConfig", LLAMA_LIKE),
    "cohere": ("CohereConfig", LLAMA_LIKE),
    "granite": ("GraniteConfig", LLAMA_LIKE),
    "olmo2": ("Olmo2Config", LLAMA_LIKE),
    "gpt_neox": ("GPTNeoXConfig", dict(CORE)),
    "gpt2": ("GPT2Config", GPT2_LIKE),  # resid/embd/attn dropout 0.1 by default
    "gpt_bigcode": ("GPTBigCodeConfig", dict(GPT2_LIKE, multi_query=True)),  # dropout 0.1 by default
    "opt": ("OPTConfig", dict(CORE, ffn_dim=64, word_embed_proj_dim=32, dropout=0.1)),
    "falcon": ("FalconConfig", dict(CORE, alibi=True, new_decoder_architecture=False, multi_query=True)),
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM of architecture ``name``, reproducibly initialised. Weights are
    scaled up from the usual 0.02 std so attention is far from uniform (a masking error must
    show in the outputs)."""
    cls_name, kwargs = ARCHS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save(name: str, path, tokenizer=None, seed: int = 0):
    """``build(name)`` saved as a model directory (with ``tokenizer`` when given)."""
    model = build(name, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
