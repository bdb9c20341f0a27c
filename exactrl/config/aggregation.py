"""The constant length normaliser of train.loss_agg=seq-mean-token-sum-norm (Dr.GRPO), written once:
every loss and step plan of a run divides by the same number."""

from __future__ import annotations


def norm_len(cfg) -> float:
    """train.loss_agg_norm, else the run's length limit: the response limit rollout.max_new_tokens of a
    command that generates (rl), the sequence limit data.max_length of one that does not (sft)."""
    if cfg.train.loss_agg_norm:
        return cfg.train.loss_agg_norm
    rollout = getattr(cfg, "rollout", None)
    return rollout.max_new_tokens if rollout is not None else cfg.data.max_length
