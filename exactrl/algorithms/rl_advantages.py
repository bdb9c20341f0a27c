"""From a rollout's rewards to what its policy terms read per token: the adaptive KL coefficient and the
advantages over the whole rollout (exactrl/advantages' estimators, stepping through each row's policy tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.advantages import AdvantageInput, get_advantage
from exactrl.advantages.estimators import EPS, whiten
from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.data.batching import pad_right
from exactrl.losses.token_losses import kl_penalty


@dataclass
class AdaptiveKL:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2; TRL's
    AdaptiveKLController): after each rollout, coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon,
    with KL the rollout's mean per-response sum of log p_old - log p_ref and n its responses.
    Without a target the coefficient stays fixed."""

    coef: float
    target: float | None
    horizon: int

    def update(self, samples: list[Sample]) -> float:
        """The coefficient for this rollout; moves it for the next one. Returns the measured KL
        (of the policy's own responses: demonstrations a mixed-policy step adds are not sampled)."""
        samples = [s for s in samples if s.source == "on_policy"]
        if not samples:  # HPT sent every question to SFT: nothing sampled to measure
            return 0.0
        kl = sum(float((s.old_logprobs - s.ref_logprobs)[len(s.prompt_ids) - 1 :].sum())
                 for s in samples) / len(samples)
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * len(samples) / self.horizon
        return kl


def attach_advantages(samples: list[Sample], cfg: RLConfig, kl_coef: float | None = None) -> None:
    """Per-token advantages (and, for ppo, the critic's returns) from the whole rollout (its
    groups are consecutive samples). ``kl_coef``: this rollout's coefficient (adaptive KL),
    else algo.kl_coef."""
    a, alg = cfg.algo, ALGORITHMS.lookup(cfg.algo.name)
    kl_coef = a.kl_coef if kl_coef is None else kl_coef
    if alg.sft_demonstrations:  # demonstrations for SFT (rollout/gated.py): nothing scored them, no term reads one
        for s in samples:
            if s.source != "on_policy":
                s.advantages = s.returns = torch.zeros(s.num_targets)
        samples = [s for s in samples if s.source == "on_policy"]
        if not samples:  # HPT sent every question of the rollout to SFT
            return
    # Estimators run over each row's policy tokens alone, gathered contiguous: a multi-turn episode's observation
    # and template tokens sit between its turns and are no step of the policy (GAE's next value, a return to go and
    # REINFORCE++'s whitening skip them); for a one-turn row this is its response.
    at = [advantage_targets(s) for s in samples]
    mask = pad_right([[1] * len(p) for p in at], 0).to(torch.float64)

    def pad(ts):
        return torch.nn.utils.rnn.pad_sequence([t.double()[p] for t, p in zip(ts, at)], batch_first=True)

    token_rewards = values = None
    if a.kl_coef > 0 and a.kl_in_reward:  # -beta * KL(old policy || reference) per token, k1
        token_rewards = -kl_coef * pad([kl_penalty(s.old_logprobs.double(), s.ref_logprobs.double(), "k1")
                                        for s in samples])
    if alg.critic:
        values = pad([s.old_values for s in samples])
    outcome = [s.reward for s in samples]
    if any(s.turn_rewards for s in samples):  # each environment step's reward on its turn's last policy token
        token_rewards = torch.zeros_like(mask) if token_rewards is None else token_rewards
        for i, s in enumerate(samples):
            for (_, end), r in zip(s.turn_spans or (), s.turn_rewards or ()):
                token_rewards[i, at[i].tolist().index(end - 1)] += r
            outcome[i] -= sum(s.turn_rewards or ())
    rewards = torch.tensor(outcome, dtype=torch.float64)
    if a.reward_norm != "none" and len(rewards) > 1:
        rewards = (rewards - rewards.mean() if a.reward_norm == "whiten" else rewards) / (rewards.std() + EPS)
    adv, returns = get_advantage(alg.advantage)(AdvantageInput(rewards, mask, a.group_size, token_rewards, values,
                                                                       gamma=a.gamma, lam=a.gae.lam,
                                                                       std_normalize=a.std_normalize))
    if alg.whiten_advantages and a.gae.whiten_advantages:
        adv = whiten(adv, mask)
    for s, p, row, ret in zip(samples, at, adv, returns):
        full = torch.zeros(2, s.num_targets, dtype=torch.float64)
        full[0, p], full[1, p] = row[: len(p)], ret[: len(p)]
        s.advantages, s.returns = full[0].float(), full[1].float()
    if alg.reshape_advantages:  # a method's own advantages from the same rewards (prefix_rft's code variant)
        alg.reshape_advantages(samples, rewards, cfg)


def advantage_targets(s: Sample) -> torch.Tensor:
    """The targets an advantage estimator steps through: the response's, less an episode's environment and
    template tokens (rollout/multiturn.py)."""
    head, origins = len(s.prompt_ids) - 1, s.origin
    return torch.tensor([t for t in range(head, s.num_targets)
                         if origins is None or origins[t] not in ("environment", "template")], dtype=torch.long)
