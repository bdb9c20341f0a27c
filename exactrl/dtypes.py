"""What each name model.dtype takes means, in one place: the dtype the forwards compute in, the
dtype a generator with its own copy of the weights (vLLM) holds them in and vLLM's name for it, and
how far that generator's log-probs may stray from the trainer's after a weight sync.

model.dtype's choices are its Literal in exactrl/config/schema.py (the config does not import torch);
tests/test_dtypes.py fails on a choice without a row here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    autocast: torch.dtype | None  # the forwards run under torch.autocast in it; None: no autocast (fp32 throughout)
    weights: torch.dtype  # what a generator holding its own copy keeps the weights in (sent cast to it)
    vllm: str  # vLLM's dtype argument for the same
    # Default weight-sync probe tolerance (rollout.probe_tol unset): max |log-prob difference| over the probe's tokens
    # between trainer and generator. fp32: other kernels (vLLM's CPU attention, fused qkv matmuls) sum in another
    # order; bf16: rounding of the weights and activations themselves.
    probe_tol: float


PRECISIONS = {
    "fp32": Precision(autocast=None, weights=torch.float32, vllm="float32", probe_tol=1e-3),
    "bf16": Precision(autocast=torch.bfloat16, weights=torch.bfloat16, vllm="bfloat16", probe_tol=0.1),
}


def autocast_for(dtype: str, device: torch.device):
    """The forwards under it compute as model.dtype=``dtype`` says (bf16: under bf16 autocast); the
    weights, their gradients and the optimizer stay fp32. Every worker of a run computes under the same one."""
    compute = PRECISIONS[dtype].autocast
    return contextlib.nullcontext() if compute is None else torch.autocast(device.type, dtype=compute)
