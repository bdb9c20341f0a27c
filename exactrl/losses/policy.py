"""Policy and value losses: pure per-token functions in a registry keyed by name, shared by
every RL algorithm. Nothing here reduces over the batch: the step's one normaliser does that
(exactrl/losses/aggregation.py).

A policy loss takes a ``PolicyInput`` ([B, T] tensors aligned with target tokens, see
token_losses.py) and returns ``(loss, ratio, clipped)``: the per-token loss, the importance
ratio it used and a 0/1 tensor marking tokens where clipping was active (for clip fraction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactrl.registry import Registry


@dataclass(frozen=True)
class PolicyInput:
    logprobs: torch.Tensor  # [B, T] under the policy being trained (carries the gradient)
    old_logprobs: torch.Tensor  # [B, T] under the policy that sampled the rollout
    advantages: torch.Tensor  # [B, T], or [B, 1] broadcast over tokens
    mask: torch.Tensor  # [B, T] response tokens that count
    clip_low: float = 0.2  # ratio kept >= 1 - clip_low where that lowers a positive-advantage objective
    clip_high: float = 0.2  # and <= 1 + clip_high; DAPO's clip-higher sets clip_high > clip_low
    dual_clip: float | None = None  # c > 1: dual-clip PPO's lower bound c * A for negative advantages; None: off


PolicyLoss = Callable[[PolicyInput], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register, get_policy_loss = POLICY_LOSSES.register, POLICY_LOSSES.lookup


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, x: PolicyInput):
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - x.clip_low, 1.0 + x.clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    active = clipped < unclipped
    if x.dual_clip is not None:
        # Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 5; verl's clip_ratio_c, OpenRLHF's
        # dual_clip): for A < 0 the objective is max(min(r A, clip(r) A), c A), so a huge ratio on a
        # bad action cannot push an unbounded gradient.
        bound = x.dual_clip * advantages
        lower = (advantages < 0) & (objective < bound)
        objective = torch.where(lower, bound, objective)
        active = active | lower
    return -objective, ratio, active.to(ratio.dtype)


@register("ppo")
def ppo_clip(x: PolicyInput):
    """PPO's clipped surrogate per token (Schulman et al. 2017, arXiv 1707.06347), as GRPO,
    RLOO and REINFORCE++ use it; with clip_high > clip_low it is DAPO's clip-higher (Yu et al.
    2025, arXiv 2503.14476), which lets low-probability tokens grow and keeps entropy up; with
    ``dual_clip`` it is dual-clip PPO."""
    return _clipped_surrogate(torch.exp(x.logprobs - x.old_logprobs), x.advantages, x)


@register("gspo")
def gspo(x: PolicyInput):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the
    geometric mean of its token ratios s_i = exp(mean_t(log p - log p_old)), clipped per
    sequence. Written per token as s_i * p_t / sg(p_t) (the paper's GSPO-token form): the value
    is s_i on every token and the gradient of the tokens' mean is exactly grad s_i, so the
    step's aggregation (seq-mean-token-mean in the paper) applies unchanged."""
    mask = x.mask.to(x.logprobs.dtype)
    log_ratio = ((x.logprobs - x.old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_ratio.detach()) * torch.exp(x.logprobs - x.logprobs.detach())
    advantages = x.advantages.expand_as(x.logprobs)
    return _clipped_surrogate(seq_ratio, advantages, x)


@register("reinforce")
def reinforce(x: PolicyInput):
    """Plain policy gradient, -A * ratio with no clipping (the ratio is 1 on-policy, where the
    gradient is -A grad log p): REINFORCE++ with one update per rollout."""
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    return -ratio * x.advantages, ratio, torch.zeros_like(ratio)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """Per-token critic loss 0.5 (V - R)^2; with ``clip``, PPO's pessimistic value clipping
    0.5 max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2) (as in OpenAI baselines
    and OpenRLHF's --value_clip)."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err


def demonstration_loss(logprobs: torch.Tensor, advantages: torch.Tensor, gamma: float | None = None,
                       clip: tuple[float, float] | None = None) -> torch.Tensor:
    """Per-token policy-gradient loss on a demonstration's tokens. The policy never sampled them
    and the demonstrator's probabilities are unknown, so the behaviour probability is taken as 1
    and the ratio is the policy's own probability p (LUFFY, Yan et al. 2025, arXiv 2504.14945;
    SRFT, Fu et al. 2025, arXiv 2506.19767). ``gamma``: LUFFY's policy shaping
    f(p) = p / (p + gamma), whose gradient gamma p / (p + gamma)^2 per unit of log p does not
    vanish on the low-probability tokens a demonstration teaches (LUFFY: gamma = 0.1);
    None: f(p) = p. ``clip``: (low, high) bounds of PPO's pessimistic clip on f(p) (SRFT's
    demonstration term as its paper writes it); None: unclipped (LUFFY: "no clip" off-policy).
    Returns -min(f(p) A, clip(f(p)) A), or -f(p) A unclipped."""
    p = torch.exp(logprobs)
    ratio = p if gamma is None else p / (p + gamma)
    surrogate = ratio * advantages
    if clip is not None:
        surrogate = torch.minimum(surrogate, ratio.clamp(1.0 - clip[0], 1.0 + clip[1]) * advantages)
    return -surrogate
