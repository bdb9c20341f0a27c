"""Model FLOPs utilisation of SFT, against the fp32 matmul peak measured on this machine.

Model FLOPs per trained token (fwd + bwd; PaLM, Chowdhery et al. 2022, appendix B):
    6 N + 12 L d T
N: weights of every matmul (every nn.Linear, lm_head included even when tied to the
embedding; embedding look-ups and norms are no matmuls); L layers, d hidden size; T the
token-weighted mean sequence length, sum(T_i^2) / sum(T_i) over the rows (the full T x T
score matrix, as masked SDPA computes it). Padding tokens are not counted, as
tokens_per_s counts only real tokens. Peak: the best GFLOP/s of torch.mm in fp32 on the
model's two MLP/attention GEMM shapes, [M x d] @ [d x I] and [M x d] @ [d x d] with M the
tokens of one SFT batch, on the same number of threads. On a GPU (gpu_bench.py): the bf16 rate
of an 8192^3 matmul, cuda_matmul_flops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelFlops:
    per_token: float
    matmul_params: int
    layers: int
    hidden: int
    intermediate: int
    seq_eff: float  # sum(T_i^2) / sum(T_i)
    seq_mean: float


def sft_flops(model_dir: str, data: str, max_length: int = 256) -> ModelFlops:
    from exactrl.data.encode import encode_sft
    from exactrl.data.jsonl import read_jsonl
    from exactrl.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(model_dir)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    lengths = [len(e.input_ids) for e in encode_sft(read_jsonl(data), load_tokenizer(model_dir), max_length)]
    c = model.config
    seq_eff = sum(t * t for t in lengths) / sum(lengths)
    return ModelFlops(6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_eff, n, c.num_hidden_layers, c.hidden_size,
                      c.intermediate_size, seq_eff, sum(lengths) / len(lengths))


def gemm_gflops(m: int, k: int, n: int, trials: int = 7, min_seconds: float = 0.2) -> float:
    """Best of ``trials`` timings of repeated [m x k] @ [k x n] fp32 products, in GFLOP/s."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    reps = 1
    while True:  # enough repetitions that one trial lasts min_seconds
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        if time.perf_counter() - t0 >= min_seconds:
            break
        reps *= 2
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * m * k * n / best / 1e9


def gemm_peak(tokens: int, hidden: int, intermediate: int) -> dict[str, float]:
    """GFLOP/s per shape; the caller takes the max as the peak."""
    return {f"[{tokens}x{hidden}]@[{hidden}x{n}]": gemm_gflops(tokens, hidden, n) for n in (intermediate, hidden)}


def cuda_matmul_flops(n: int, dtype: torch.dtype, trials: int = 5, reps: int = 20) -> float:
    """Best of ``trials`` timings of ``reps`` [n x n] @ [n x n] products on the GPU, in FLOP/s (a sync
    around each timing: the launches return before the GPU is done)."""
    from worker_common import Device

    gpu = Device("cuda")
    a, b = torch.randn(n, n, dtype=dtype, device="cuda"), torch.randn(n, n, dtype=dtype, device="cuda")
    out = torch.empty(n, n, dtype=dtype, device="cuda")
    for _ in range(3):  # warm-up: cuBLAS picks its kernel
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(trials):
        gpu.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        gpu.sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * n**3 / best
