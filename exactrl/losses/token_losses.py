"""Per-token losses. Pure functions: [batch, time] in, [batch, time] out, never reduced.

Positions are aligned with *targets*: for input ids x[0..L), logits at position t predict
x[t+1], so every tensor here has length L-1 and ``mask`` marks targets that count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x[t+1] | x[..t]) for every position, at ``temperature`` (logits are divided by it,
    matching how the rollout engine sampled). Computed in fp32 whatever the forward dtype."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    # cross_entropy fuses log-softmax and gather without keeping a [B, T, V] log-prob tensor.
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return -nll.view(targets.shape)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution at each target position (for metrics)."""
    logits = logits[:, :-1].float() / temperature
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token."""
    return -logprobs


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    With r = p_ref / p (Schulman, "Approximating KL divergence", 2020): k1 = -log r (unbiased,
    can be negative; the usual per-token KL in the reward), k2 = (log r)^2 / 2 (low variance,
    its gradient is that of the reverse KL), k3 = (r - 1) - log r (non-negative and unbiased,
    the GRPO paper's choice).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}'; choose k1, k2 or k3")
