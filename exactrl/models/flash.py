"""flash-attention's varlen kernel for packed rows (the optional ``flash-attn`` extra).

``flash_attn_varlen_func`` takes a packed row as it is -- [tokens, heads, dim] with the
cumulative sequence lengths ``model_batch`` already builds -- and keeps attention within each
sequence itself: no gather into a padded block, no mask, fewer key/value heads than query heads
handled natively. It runs only on CUDA and only in fp16/bf16 (under model.dtype=bf16's autocast,
in bf16), so ``varlen_attention`` uses it when ``flash_available`` says so and the model's
kernel is SDPA; fp32, the CPU and an explicit
``model.attn_implementation=eager`` keep the packed SDPA/eager path. The packing self-check
(exactrl/checks/packing.py) names the kernel the packed path ran and compares flash against it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _varlen_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # not installed, or a build for another CUDA/torch
        return None
    return flash_attn_varlen_func


def _on_cuda(query: torch.Tensor) -> bool:
    return query.is_cuda


def half_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The half dtype a half-precision-only kernel (flash-attention's, torch's varlen) would run
    these in, None for fp32. Under autocast it is autocast's dtype, as Hugging Face's flash path
    does: queries and keys leave the rotary embedding in fp32 there (its cos/sin follow the fp32
    residual stream), values come out of their projection in bf16."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    else:
        dtype = query.dtype if key.dtype == value.dtype == query.dtype else None
    return dtype if dtype in HALF else None


def _flash_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The dtype flash-attention would run these in, None where it cannot run (the CPU, fp32)."""
    return half_dtype(query, key, value) if _on_cuda(query) else None


def flash_available(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[Callable, torch.dtype] | None:
    """flash-attention's varlen function and the dtype to run these tensors in, when it can:
    installed, on CUDA, in half precision. Tried on CUDA only, so a CPU run never imports it."""
    dtype = _flash_dtype(query, key, value)
    fn = _varlen_fn() if dtype is not None else None
    return None if fn is None else (fn, dtype)


def flash_varlen_attention(fn: Callable, dtype: torch.dtype, query, key, value, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, sliding_window: int | None = None,
                           softcap: float | None = None, dropout: float = 0.0,
                           scaling: float | None = None) -> torch.Tensor:
    """Per-sequence causal attention of a packed row through ``fn`` (flash_attn_varlen_func) in
    ``dtype``. query [1, H, N, D], key/value [1, Hkv, N, D] as Hugging Face's attention layers
    pass them; returns [1, N, H, D] in ``dtype`` as its attention functions do."""
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [N, H, D], the last dim stays contiguous
    # flash-attention's window is inclusive, (left, right): query i sees keys i - left .. i + right.
    # exactrl's (and Hugging Face's) rule i - window < j <= i is left = window - 1; causal makes right 0.
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    out = fn(q, k, v, cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
             max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), dropout_p=dropout, softmax_scale=scaling,
             causal=True, window_size=window, softcap=0.0 if softcap is None else softcap,
             # Its default backward adds dq with atomics in a run-dependent order; exactrl's
             # steps must be reproducible (resume, the canary, the equivalence checks).
             deterministic=True)
    return (out[0] if isinstance(out, tuple) else out).unsqueeze(0)
