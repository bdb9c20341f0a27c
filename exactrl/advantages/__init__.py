"""Advantage estimators: pure functions from rewards (and values) to advantages, by name."""

from exactrl.advantages.estimators import ADVANTAGES, AdvantageInput, get_advantage, group_advantages

__all__ = ["ADVANTAGES", "AdvantageInput", "get_advantage", "group_advantages"]
