"""The canary: each optimizer step proves the gradient carries every micro-batch exactly once.

A scalar parameter outside the model gets the loss term ``c * share_i`` in micro-batch i,
where ``share_i`` is that micro-batch's fraction of the step's total loss weight under the
step's one normaliser (exactrl.losses.canary_share). Counted once each, the shares add up to
exactly 1, so at the point where the optimizer reads gradients the canary's gradient must be
1. A dropped micro-batch (DeepSpeed ZeRO-2 CPU offload with K >= 3, PR #6550 -> #7967), a
duplicated one, per-micro-batch normalisers whose shares do not add up to 1 (means summed
over micro-batches) or a backend averaging the engine did not account for all move it away
from 1. The mean of micro-batch means (OpenRLHF <= 0.10.2, fault.mean_of_means) does not:
every micro-batch still arrives once with its share 1/M; it is another loss, not a lost gradient.

The canary never touches the model: it is not in the model's graph, not in the gradient norm
or clipping, not in checkpoints, and its gradient is zeroed after every check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class CanaryError(RuntimeError):
    """The optimizer was about to apply a gradient that does not carry the step exactly once."""


class CanaryModule(torch.nn.Module):
    """One parameter, called like a layer so that a backend (FSDP2, DeepSpeed) can manage,
    reduce and offload it exactly as it does the model's parameters."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, share: float) -> torch.Tensor:
        return (self.weight * share).sum()


class Canary:
    def __init__(self, policy: str, tol: float, describe: Callable[[], str]):
        if policy not in ("error", "warn"):
            raise ValueError(f"canary policy must be error or warn (off: build no canary), got {policy!r}")
        self.policy, self.tol, self.describe = policy, tol, describe
        self.module = CanaryModule()
        self.fired = 0  # steps it flagged (policy warn), logged as a running total: a study reports it

    @property
    def param(self) -> torch.nn.Parameter:
        return self.module.weight

    def term(self, share: float) -> torch.Tensor:
        """The loss term that adds ``share`` to the canary's gradient."""
        return self.module(share)

    def read(self) -> float:
        """The canary's accumulated gradient where the optimizer reads it (full value if sharded)."""
        grad = self.param.grad
        if grad is None:
            return 0.0
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return float(full.sum())

    def check(self, step: int, micro_batches: int) -> float:
        """Read the accumulated canary gradient, compare with 1, reset it. Returns the reading."""
        value = self.read()
        self.param.grad = None
        return self.verify(value, step, micro_batches)

    def verify(self, value: float, step: int, micro_batches: int) -> float:
        """Compare a reading taken by the engine with 1 and act on the policy."""
        if abs(value - 1.0) > self.tol:
            msg = (f"canary failed at optimizer step {step}: the accumulated gradient carries {value:.6g} of the "
                   f"step's loss instead of exactly 1 (tolerance {self.tol:g}) over {micro_batches} micro-batches; "
                   f"{self.describe()}. A value near (first + last share) means dropped micro-batches, above 1 "
                   "duplicated ones; see docs/audit.md")
            if self.policy == "error":
                raise CanaryError(msg)
            self.fired += 1
            if self.fired == 1:  # once: a broken backend fails every step; the count goes on in metrics
                log.warning(msg + " (audit.canary=warn: the run goes on; later failures are counted in the metrics "
                            "as canary_fired)")
        return value
