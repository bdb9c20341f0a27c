"""Pure loss functions (per-token values, never reduced over the batch) and aggregation modes."""

from exactrl.losses.aggregation import AGG_MODES, StepNormalizer, aggregate, canary_share

__all__ = ["AGG_MODES", "StepNormalizer", "aggregate", "canary_share"]
