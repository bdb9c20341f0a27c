"""The on-policy check (rl): at the first update after a rollout the policy ratio must be 1. A
deviation means the log-probs the loss uses are stale or computed differently from the forward
that trains (the failure mode behind DeepSpeed-Chat's "one generation batch, one PPO epoch"
guidance)."""

from __future__ import annotations

import warnings


class OnPolicyCheckError(RuntimeError):
    """The policy ratio was not 1 at the first update after a rollout."""


def check_on_policy(deviation: float, cfg, rollout: int, against_generator: bool = False) -> None:
    """The first update after a rollout must see ratio 1: against old log-probs from the same
    forward code (``algo.ratio_tol``), or, when a one-update rollout skips that pass, against
    the log-probs the generator sampled with (``algo.gen_ratio_tol``: KV-cached single-token
    decoding sums in another order; 2.4e-4 was seen 15 steps into examples/grpo_tiny.yaml,
    while a generator with stale or wrong weights is off by far more)."""
    key = "gen_ratio_tol" if against_generator else "ratio_tol"
    tol = getattr(cfg.algo, key)
    if cfg.algo.ratio_check == "off" or deviation <= tol:
        return
    what = "the generator's log-probs are" if against_generator else "the old log-probs are"
    msg = (f"on-policy check failed at rollout {rollout}: max |ratio - 1| = {deviation:.3g} > algo.{key}={tol} "
           f"at the first update after the rollout; {what} stale or computed differently from the loss's")
    if cfg.algo.ratio_check == "error":
        raise OnPolicyCheckError(msg)
    warnings.warn(msg, stacklevel=2)
