"""The on-policy check (rl): at the first update after a rollout the policy ratio must be 1. A
deviation means the log-probs the loss uses are stale or computed differently from the forward
that trains (the failure mode behind DeepSpeed-Chat's "one generation batch, one PPO epoch"
guidance)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


class OnPolicyCheckError(RuntimeError):
    """The policy ratio was not 1 at the first update after a rollout."""


@dataclass(frozen=True)
class OnPolicyCheck:
    """The check as data, declared in a step's objective: the worker verifies the step's max
    |ratio - 1| over all ranks before the step is applied."""

    tol: float
    key: str  # the config key of ``tol``, named in the message
    mode: str  # algo.ratio_check: error, warn or off
    rollout: int
    against_generator: bool = False

    def verify(self, deviation: float) -> None:
        if self.mode == "off" or deviation <= self.tol:
            return
        what = "the generator's log-probs are" if self.against_generator else "the old log-probs are"
        msg = (f"on-policy check failed at rollout {self.rollout}: max |ratio - 1| = {deviation:.3g} > "
               f"algo.{self.key}={self.tol} at the first update after the rollout; {what} stale or computed "
               "differently from the loss's")
        if self.mode == "error":
            raise OnPolicyCheckError(msg)
        warnings.warn(msg, stacklevel=3)


def on_policy_check(cfg, rollout: int, against_generator: bool = False) -> OnPolicyCheck:
    """The first update after a rollout must see ratio 1: against old log-probs from the same
    forward code (``algo.ratio_tol``), or, when a one-update rollout skips that pass, against
    the log-probs the generator sampled with (``algo.gen_ratio_tol``: KV-cached single-token
    decoding sums in another order; 2.4e-4 was seen 15 steps into examples/grpo_tiny.yaml,
    while a generator with stale or wrong weights is off by far more)."""
    key = "gen_ratio_tol" if against_generator else "ratio_tol"
    return OnPolicyCheck(getattr(cfg.algo, key), key, cfg.algo.ratio_check, rollout, against_generator)

