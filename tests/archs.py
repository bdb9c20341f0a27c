"""Tiny randomly initialised decoders of many Hugging Face architectures, built from
transformers' own config classes, for the architecture matrix (tests/test_arch_matrix.py).

Each is small enough for a forward in milliseconds, yet keeps what makes its family differ:
sliding windows narrower than the test sequences, Gemma2's attention-logit softcapping,
ALiBi (Bloom, Falcon), multi-query attention (GPT-BigCode), dropout left on as the family's
configs ship it (GPT-2, OPT, GPT-BigCode, Seed-OSS), mixture-of-experts (Qwen3-MoE and many
more); and of the 2026 families: linear attention (gated delta-net, Kimi delta attention,
lightning attention) and Mamba or short-convolution mixers beside attention, attention sinks,
multi-head latent attention and DeepSeek's sparse top-k attention, Llama 4's chunked attention
and NoPE temperature, PhiMoE's random routing in train mode, Gemma 3n's shared keys and values.
Their torch fallbacks run (no flash-linear-attention, causal-conv1d or mamba-ssm kernels)."""

from __future__ import annotations

import torch
import transformers

VOCAB, WINDOW = 103, 8  # the built-in character tokenizer's vocabulary
CORE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LLAMA_LIKE = dict(CORE, num_key_value_heads=2)
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
GDN = {"head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
       "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
       "v_head_dim": 6}  # keys 12 wide, values 6
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": WINDOW}
INDEX_TOPK, CHUNK = 8, 6  # DeepSeek-V3.2's keys per query, Llama 4's attention chunk
GPT2_LIKE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)

# name -> (config class, kwargs)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", LLAMA_LIKE),
    "qwen2": ("Qwen2Config", LLAMA_LIKE),
    "qwen3": ("Qwen3Config", dict(LLAMA_LIKE, head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(LLAMA_LIKE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16,
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
    # --- 2026 families. Each keeps the mechanism that sets it apart, sized so the test lengths
    # (sequences of up to 24 tokens, 16 tokens decoded after prompts of 8) reach it.
    # Gated delta-net linear attention (torch fallback: chunks of 64, a constant, so one chunk here)
    # before a gated full attention layer.
    "qwen3_5": ("Qwen3_5TextConfig", dict(LLAMA_LIKE, **GDN)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(LLAMA_LIKE, **GDN, **MOE, num_experts=4,
                                                 shared_expert_intermediate_size=16)),
    "qwen3_next": ("Qwen3NextConfig", dict(LLAMA_LIKE, **GDN, **MOE, num_experts=4,
                                           shared_expert_intermediate_size=16)),
    # Attention sinks (s_aux), a sliding layer then a full one, MoE with clamped SwiGLU; YaRN as shipped.
    "gpt_oss": ("GptOssConfig", dict(LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, num_local_experts=4,
                                     num_experts_per_tok=2,
                                     intermediate_size=16, max_position_embeddings=131072)),
    # Multi-head latent attention: keys 12 wide (8 + 4 rotary), values 6; the cache holds the latents.
    "deepseek_v3": ("DeepseekV3Config", dict(LLAMA_LIKE, **MLA, **MOE, num_key_value_heads=4, n_routed_experts=4,
                                             n_group=2,
                                             topk_group=1, first_k_dense_replace=1)),
    # DeepSeek sparse attention: the indexer keeps 8 keys per query. 2 indexer heads: ReLU zeroes both
    # heads' scores for many keys, and torch.topk breaks those exact ties by the row's width
    # (exactrl/models/dsa.py keeps the earliest): padded beside a 40-token row, sequences of 23 and
    # 33 tokens kept other keys than alone.
    "deepseek_v32": ("DeepseekV32Config", dict(LLAMA_LIKE, **MLA, **MOE, num_key_value_heads=4, n_routed_experts=4,
                                               n_group=2,
                                               topk_group=1, first_k_dense_replace=1, index_topk=INDEX_TOPK,
                                               index_head_dim=8, index_n_heads=2)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(LLAMA_LIKE, **MLA, **MOE, num_key_value_heads=4, n_routed_experts=4)),
    # Kimi delta attention (linear; chunks of 64) + MLA full attention without RoPE.
    "kimi_linear": ("KimiLinearConfig", dict(LLAMA_LIKE, **MLA, **MOE, num_key_value_heads=4, num_experts=4,
                                             linear_head_dim=8,
                                             linear_num_heads=4, layer_types=["linear_attention", "full_attention"])),
    # Mamba-2 mixers (torch SSD fallback, chunks of 8) beside (Falcon-H1) or between attention layers;
    # Granite 4.0-H and Nemotron-H attention without RoPE.
    "falcon_h1": ("FalconH1Config", dict(LLAMA_LIKE, **MAMBA2, mamba_d_ssm=64)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(LLAMA_LIKE, **MAMBA2, num_local_experts=4,
                                                        num_experts_per_tok=2,
                                                        shared_intermediate_size=16, layer_types=[
                                                            "mamba", "attention"])),
    # time_step_min: the chunked scan's lower limit on the step size, which Hugging Face's one-token
    # step leaves out; 0.005 makes it bind often enough that decoding is off the training forward by
    # ~3e-3 in log-prob, past the generation check's tolerance (as probes of other sizes found).
    "nemotron_h": ("NemotronHConfig", dict(LLAMA_LIKE, head_dim=8, num_hidden_layers=4, mamba_num_heads=4,
                                           mamba_head_dim=16, time_step_min=0.005,
                                           ssm_state_size=8, n_groups=1, chunk_size=WINDOW, n_routed_experts=4,
                                           moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                           layers_block_type=["mamba", "moe", "attention", "mlp"])),
    # Mamba-1 (selective scan) + attention without RoPE, MoE every other layer.
    "jamba": ("JambaConfig", dict(LLAMA_LIKE, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                  expert_layer_period=2, expert_layer_offset=1, num_experts=4, mamba_d_state=8)),
    "bamba": ("BambaConfig", dict(LLAMA_LIKE, **MAMBA2, attn_layer_indices=[1])),
    # Short gated convolutions (kernel 3) + attention.
    "lfm2": ("Lfm2Config", dict(LLAMA_LIKE, block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"])),
    "lfm2_moe": ("Lfm2MoeConfig", dict(LLAMA_LIKE, **MOE, num_experts=4, num_dense_layers=1, num_hidden_layers=3,
                                       layer_types=["conv", "full_attention", "conv"])),
    # Lightning (linear) attention in blocks of 8, then a softmax attention layer (MiniMax-01's order: its
    # first layer is linear); a cache class of its own, whose length is layer 0's (none: linear), so
    # generate's left-padded decode steps build a wrong mask.
    "minimax": ("MiniMaxConfig", dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, block_size=WINDOW,
                                      layer_types=["linear_attention", "full_attention"])),
    "mamba2": ("Mamba2Config", {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
                                "head_dim": 16,
                                "state_size": 8, "n_groups": 1, "chunk_size": WINDOW, "pad_token_id": 0,
                                "bos_token_id": 1,
                                "eos_token_id": 2}),
    # Chunked attention (chunks of 6) on the RoPE layers; the NoPE layers scale queries by a temperature
    # that steps every floor_scale=4 positions.
    "llama4": ("Llama4TextConfig", dict(LLAMA_LIKE, head_dim=8, num_hidden_layers=4, no_rope_layer_interval=2,
                                        attention_chunk_size=CHUNK, attn_temperature_tuning=True, floor_scale=4,
                                        num_local_experts=4, intermediate_size=16, intermediate_size_mlp=64,
                                        interleave_moe_layer_step=2)),
    # sparsemixer routing; router_jitter_noise left at the shipped 0.01: random routing in train mode.
    "phimoe": ("PhimoeConfig", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)),
    # AltUp, LAuReL, per-layer inputs, the last 2 layers reusing earlier keys and values, activation
    # sparsity on the first 2 layers, final logit softcapping.
    "gemma3n_text": ("Gemma3nTextConfig", dict(LLAMA_LIKE, head_dim=8, num_hidden_layers=4, sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention"] * 2,
                                               num_kv_shared_layers=2,
                                               vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                                               laurel_rank=4,
                                               activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0])),
    # Families an earlier survey found working, for coverage.
    "glm4": ("Glm4Config", dict(LLAMA_LIKE, head_dim=8)),  # post-norms, half-rotary
    "glm4_moe": ("Glm4MoeConfig", dict(LLAMA_LIKE, head_dim=8, **MOE, n_routed_experts=4, use_qk_norm=True)),
    "smollm3": ("SmolLM3Config", dict(LLAMA_LIKE, num_hidden_layers=4)),  # the 4th layer without RoPE
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(LLAMA_LIKE, **MOE, moe_num_experts=4, moe_num_shared_experts=1)),
    "exaone4": ("Exaone4Config", dict(LLAMA_LIKE, sliding_window=WINDOW, sliding_window_pattern=2)),
    "olmo3": ("Olmo3Config", dict(LLAMA_LIKE, sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention"])),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(LLAMA_LIKE, head_dim=8)),
    "minimax_m2": ("MiniMaxM2Config", dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=16)),
    "seed_oss": ("SeedOssConfig", dict(LLAMA_LIKE, head_dim=8)),  # attention and residual dropout 0.1 by default
    "apertus": ("ApertusConfig", dict(LLAMA_LIKE, max_position_embeddings=65536)),  # xIELU; llama3 RoPE as shipped
    "arcee": ("ArceeConfig", dict(LLAMA_LIKE)),  # ReLU^2 MLP
    "dots1": ("Dots1Config", dict(LLAMA_LIKE, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                  sliding_window=WINDOW, max_window_layers=1)),  # layer 2 sliding
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM of architecture ``name``, reproducibly initialised. Weights are
    scaled up from the usual 0.02 std so attention is far from uniform (a masking error must
    show in the outputs). The pad token gets an embedding like any other (initialisation leaves
    it zero): a random policy samples it, and a zero embedding makes every score of a top-k
    choice equal there (DSA's keys, MoE experts), which ties break differently by batch layout."""
    cls_name, kwargs = ARCHS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for emb in model.modules():
            if isinstance(emb, torch.nn.Embedding) and emb.padding_idx is not None:
                emb.weight[emb.padding_idx] = 0.2 * torch.randn(emb.embedding_dim)
    return model


def save(name: str, path, tokenizer=None, seed: int = 0):
    """``build(name)`` saved as a model directory (with ``tokenizer`` when given)."""
    model = build(name, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
