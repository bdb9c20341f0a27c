"""Fast kernels for packed rows: the sequences of a row attend within themselves without being
gathered into a padded block (exactrl/models/packing.py's reference path).

``attend`` picks, for one packed call, the first of these that can take the layer and that the
model allows (``model.packed_kernel``, and the packing self-check, which turns off a kernel that
disagrees with the gather path: exactrl/checks/packing.py):

1. ``flash_attn varlen``: the flash-attn package's varlen kernel (exactrl/models/flash.py): CUDA,
   fp16/bf16; sliding windows and logit softcapping.
2. ``torch varlen``: ``torch.nn.attention.varlen.varlen_attn``, PyTorch's bundled
   flash-attention kernel behind a varlen API (no package to compile). CUDA, fp16/bf16. What it
   takes grew over releases, so it is read from its signature: 2.10 has ``is_causal`` only; later
   ones ``scale`` and ``window_size`` (flash-attention's inclusive (left, right)); 2.12 and on
   ``enable_gqa`` (before that, keys and values are repeated to the query heads). No softcap.
3. ``flex varlen``: ``flex_attention`` with a block mask "same sequence, causal (and within the
   window / chunk)" built from the cumulative lengths, softcap as a score_mod; compiled on CUDA
   (uncompiled it materialises the scores: a reference, not a fast path). Any dtype.

None of them applies attention sinks (gpt-oss) or dropout; those layers, fp32 on a machine
without flex, the CPU and an explicit ``model.attn_implementation=eager`` keep the gather path.
"""

from __future__ import annotations

import functools
import inspect

import torch

from exactrl.models import flash

FLASH, TORCH, FLEX = "flash_attn varlen", "torch varlen", "flex varlen"
FAST = (FLASH, TORCH, FLEX)  # in the order tried
# model.packed_kernel's values: auto (the first that can run), one kernel alone (else the gather path)
SETTINGS = {"auto": FAST, "flash": (FLASH,), "torch_varlen": (TORCH,), "flex": (FLEX,), "gather": ()}

# The flex path on the CPU, uncompiled: tests compare it with the gather path there (torch 2.13
# refuses flex's backward on the CPU in its input check; the tests lift that check).
FLEX_ON_CPU = False


def _on_cuda(query: torch.Tensor) -> bool:
    return query.is_cuda


def _varlen_dtype(query, key, value) -> torch.dtype | None:
    """The dtype torch's varlen kernel would run these in: half precision on CUDA, else None."""
    return flash.half_dtype(query, key, value) if _on_cuda(query) else None


@functools.cache
def _torch_varlen():
    """(varlen_attn, the names of its parameters), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def attend(module, query, key, value, cu: torch.Tensor, max_len: int, window: int | None, chunk: int | None,
           softcap: float | None, scaling: float | None, dropout: float,
           sinks: bool) -> tuple[str, torch.Tensor] | None:
    """(kernel name, output [1, N, H, D]) of the first fast kernel that can take this packed call
    (query [1, H, N, D], key/value [1, Hkv, N, D]) and that ``module`` allows; None: the gather
    path. None applies attention ``sinks``; only flash-attention applies ``dropout``."""
    if sinks:
        return None
    allowed = SETTINGS[getattr(module, "exactrl_packed_kernel", "auto")]
    off = getattr(module, "exactrl_kernels_off", frozenset())
    for name in (n for n in allowed if n not in off):
        if name == FLASH and chunk is None:
            fast = flash.flash_available(query, key, value)
            if fast is not None:
                return name, flash.flash_varlen_attention(*fast, query, key, value, cu, cu, max_len, max_len, window,
                                                          softcap, dropout, scaling)
        elif dropout:
            continue
        elif name == TORCH and chunk is None and softcap is None:
            out = _torch_varlen_attention(query, key, value, cu, max_len, window, scaling)
            if out is not None:
                return name, out
        elif name == FLEX and (_on_cuda(query) or FLEX_ON_CPU):
            return name, flex_varlen_attention(query, key, value, cu, window, chunk, softcap, scaling)
    return None


def _torch_varlen_attention(query, key, value, cu, max_len: int, window: int | None, scaling: float | None):
    """Per-sequence causal attention through torch's varlen_attn, or None where it cannot take
    the call (absent, not CUDA half precision, a window or scale this torch's signature lacks,
    keys and values of different widths)."""
    found, dtype = _torch_varlen(), _varlen_dtype(query, key, value)
    if found is None or dtype is None or key.shape[-1] != value.shape[-1]:
        return None
    fn, params = found
    window = window if window is not None and window < max_len else None  # as wide as the row: plain causal
    default_scale = scaling is None or scaling == query.shape[-1] ** -0.5
    if (window is not None and "window_size" not in params) or (not default_scale and "scale" not in params):
        return None
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [N, H, D]
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    if "window_size" in params:
        # A tuple: varlen_attn takes (-1, 0), and only that, as causal. Its window is inclusive:
        # exactrl's (Hugging Face's) i - window < j <= i is window - 1 keys back.
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if not default_scale:
        kwargs["scale"] = scaling
    cu = cu.to(torch.int32)
    return fn(q, k, v, cu, cu, int(max_len), int(max_len), **kwargs).unsqueeze(0)


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


@functools.cache
def _compiled_flex():
    # Compiled once per process; the row's length varies from step to step, which torch.compile's
    # automatic dynamic shapes absorbs after the second length.
    return torch.compile(_flex())


def document_mask_mod(cu: torch.Tensor, n: int, window: int | None, chunk: int | None):
    """flex's mask_mod for a packed row of ``n`` tokens: query q sees key k when both lie in
    the same sequence, k <= q, fewer than ``window`` positions back, and in the same ``chunk``
    of their sequence's positions (Llama 4), as packing.window_mask's rule within one sequence."""
    tokens = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cu[1:].to(torch.long), tokens, right=True)  # the sequence of each token
    pos = tokens - cu.to(torch.long)[seq]  # its position in that sequence

    def mask_mod(b, h, q, k):
        seen = (seq[q] == seq[k]) & (k <= q)
        if window is not None:
            seen = seen & (q - k < window)
        if chunk is not None:
            seen = seen & (pos[q] // chunk == pos[k] // chunk)
        return seen

    return mask_mod


# One packed row's block masks, per (window, chunk): every layer of a forward (and its
# recomputation under checkpointing) passes the same cumulative-lengths tensor.
_masks: dict = {}


def _block_mask(cu: torch.Tensor, n: int, window: int | None, chunk: int | None, device):
    from torch.nn.attention.flex_attention import create_block_mask
    if _masks.get("cu") is not cu:
        _masks.clear()
        _masks["cu"] = cu
    key = (n, window, chunk)
    if key not in _masks:
        # Compiled on CUDA: uncompiled, create_block_mask evaluates the mask on all n x n pairs.
        _masks[key] = create_block_mask(document_mask_mod(cu, n, window, chunk), None, None, n, n, device=device,
                                        _compile=device.type == "cuda")
    return _masks[key]


def flex_varlen_attention(query, key, value, cu: torch.Tensor, window: int | None, chunk: int | None,
                          softcap: float | None, scaling: float | None) -> torch.Tensor:
    """Per-sequence causal attention of a packed row through flex_attention. query [1, H, N, D],
    key/value [1, Hkv, N, D(v)]; returns [1, N, H, Dv]. Under autocast it runs in autocast's
    dtype (flex takes one dtype; queries and keys leave the rotary embedding in fp32 there)."""
    device = query.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else query.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    n = q.shape[2]
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, k_idx):  # after the scale, as the eager path applies it
            return torch.tanh(score / softcap) * softcap
    fn = _compiled_flex() if device.type == "cuda" else _flex()
    out = fn(q, k, v, score_mod=score_mod, block_mask=_block_mask(cu, n, window, chunk, device), scale=scaling,
             enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
