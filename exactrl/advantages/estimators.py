"""Advantage estimators: pure functions from a rollout's rewards (and values) to per-token
advantages and returns, in a registry keyed by the names users know (verl's core_algos, OpenRLHF's
--advantage_estimator).

Every estimator takes an ``AdvantageInput`` and returns ``(advantages, returns)``, both
[N, T] and zero outside ``mask``. Responses come in whole groups of ``group_size`` consecutive
rows (the responses to one prompt). Outcome-reward estimators ignore ``values``; GAE needs them.
Every estimator reads ``token_rewards`` (the KL in the reward); ``TOKEN_REWARDS`` says how, and
rl.py refuses algo.kl_in_reward for an estimator that does not declare it, so a KL cannot
land nowhere.
Batch-level statistics (REINFORCE++'s whitening) are taken over what is passed in: the caller
passes the whole global rollout (all ranks), so advantages never depend on how it is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactrl.registry import Registry

EPS = 1e-6


@dataclass(frozen=True)
class AdvantageInput:
    rewards: torch.Tensor  # [N] outcome reward of each response
    mask: torch.Tensor  # [N, T] 1 on the response tokens that count
    group_size: int = 1  # responses per prompt, consecutive
    token_rewards: torch.Tensor | None = None  # [N, T] per-token reward terms, e.g. -beta * KL (KL in the reward)
    values: torch.Tensor | None = None  # [N, T] critic values V(s_t) of the old policy (PPO)
    gamma: float = 1.0
    lam: float = 1.0  # GAE lambda
    std_normalize: bool = True  # GRPO: divide by the group's std


Estimator = Callable[[AdvantageInput], tuple[torch.Tensor, torch.Tensor]]
ADVANTAGES: Registry[Estimator] = Registry("advantage estimator")
register, get_advantage = ADVANTAGES.register, ADVANTAGES.lookup


def _groups(x: AdvantageInput) -> torch.Tensor:
    if x.rewards.numel() % x.group_size:
        raise ValueError(f"{x.rewards.numel()} rewards do not form whole groups of {x.group_size}")
    return x.rewards.to(torch.float64).view(-1, x.group_size)


def _per_token(per_response: torch.Tensor, x: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_response.view(-1, 1).to(x.mask.dtype) * x.mask
    return adv, adv


def _scores(x: AdvantageInput) -> torch.Tensor:
    """Each response's score for a group baseline: its outcome reward plus the sum of its
    per-token reward terms over its response tokens, as verl does for the KL in the reward
    (apply_kl_penalty, then compute_grpo_outcome_advantage on token_level_rewards.sum(-1))."""
    if x.token_rewards is None:
        return x.rewards
    return x.rewards + (x.token_rewards.to(torch.float64) * x.mask.to(torch.float64)).sum(1).to(x.rewards.dtype)


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True,
                     eps: float = EPS) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std(group) + eps), one value per response (GRPO, Shao et al.
    2024, arXiv 2402.03300). std is the unbiased sample std, as in the paper and TRL.
    ``std_normalize=False`` keeps only the centring (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783:
    the std division over-weights groups that are nearly all right or all wrong)."""
    groups = _groups(AdvantageInput(rewards, rewards.new_ones(rewards.numel(), 1), group_size))
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.view(-1).to(rewards.dtype)


@register("grpo")
def grpo(x: AdvantageInput):
    return _per_token(group_advantages(_scores(x), x.group_size, x.std_normalize), x)


@register("dr_grpo")
def dr_grpo(x: AdvantageInput):
    return _per_token(group_advantages(_scores(x), x.group_size, std_normalize=False), x)


@register("rloo")
def rloo(x: AdvantageInput):
    """A_i = r_i - mean of the *other* responses to the prompt (Ahmadian et al. 2024, arXiv
    2402.14740), i.e. G/(G-1) (r_i - group mean): an unbiased baseline."""
    if x.group_size < 2:
        raise ValueError("rloo needs algo.group_size >= 2 (the baseline is the other responses' mean)")
    g = _groups(AdvantageInput(_scores(x), x.mask, x.group_size))
    others = (g.sum(dim=1, keepdim=True) - g) / (x.group_size - 1)
    return _per_token((g - others).view(-1), x)


def _token_rewards(x: AdvantageInput, outcome: torch.Tensor) -> torch.Tensor:
    """r_t: the per-token reward terms, plus the outcome reward on each response's last token."""
    mask = x.mask.to(torch.float64)
    r = torch.zeros_like(mask) if x.token_rewards is None else x.token_rewards.to(torch.float64) * mask
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    return r + last * outcome.view(-1, 1)


def _discounted_sum(r: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """out_t = sum_{s >= t} discount^(s-t) r_s within each response (zero outside it)."""
    mask = mask.to(r.dtype)
    out, running = torch.zeros_like(r), torch.zeros_like(r[:, 0])
    for t in range(r.size(1) - 1, -1, -1):
        running = (r[:, t] + discount * running) * mask[:, t]
        out[:, t] = running
    return out


def _reward_to_go(x: AdvantageInput, outcome: torch.Tensor) -> torch.Tensor:
    return _discounted_sum(_token_rewards(x, outcome), x.mask, x.gamma)


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(v - mean) / std over the masked tokens of the whole batch (unbiased std)."""
    m = mask.to(torch.float64)
    n = m.sum()
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + EPS) * m


@register("reinforce_pp")
def reinforce_pp(x: AdvantageInput):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): the return to go of the outcome reward and the
    per-token KL penalty, whitened over every token of the global batch (no critic, no group)."""
    returns = _reward_to_go(x, x.rewards.to(torch.float64))
    return whiten(returns, x.mask).to(x.mask.dtype), returns.to(x.mask.dtype)


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(x: AdvantageInput):
    """REINFORCE++-baseline: the prompt's mean reward is subtracted first (group baseline), then
    the same return to go and global whitening as reinforce_pp."""
    g = _groups(x)
    returns = _reward_to_go(x, (g - g.mean(dim=1, keepdim=True)).view(-1))
    return whiten(returns, x.mask).to(x.mask.dtype), returns.to(x.mask.dtype)


@register("gae")
def gae(x: AdvantageInput):
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438) over the
    response tokens: delta_t = r_t + gamma V(s_{t+1}) - V(s_t) with V = 0 after the last token;
    A_t = sum_k (gamma lam)^k delta_{t+k}; returns = A + V (the critic's targets)."""
    if x.values is None:
        raise ValueError("gae needs the critic's values (algo.name=ppo)")
    mask = x.mask.to(torch.float64)
    values = x.values.to(torch.float64) * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # 0 after the last token
    deltas = _token_rewards(x, x.rewards.to(torch.float64)) + x.gamma * next_values - values
    adv = _discounted_sum(deltas * mask, mask, x.gamma * x.lam)
    return adv.to(x.mask.dtype), ((adv + values) * mask).to(x.mask.dtype)


@register("none")
def no_advantages(x: AdvantageInput):
    """Zero advantages: a method whose objective reads none (on-policy distillation: its per-token signal is the
    teacher's, in its own term)."""
    zeros = torch.zeros_like(x.mask)
    return zeros, zeros


# How each estimator takes the per-token reward terms (the KL in the reward).
TOKEN_REWARDS = {
    "grpo": "summed into each response's score before the group baseline (verl)",
    "dr_grpo": "summed into each response's score before the group baseline (verl)",
    "rloo": "summed into each response's score before the leave-one-out baseline (verl)",
    "reinforce_pp": "per token, in the return to go",
    "reinforce_pp_baseline": "per token, in the return to go after the group baseline",
    "gae": "per token, in GAE's rewards",
}
