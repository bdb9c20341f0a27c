"""The one rule of the maths: one loss per optimizer step, one normaliser for the whole step.

Every aggregation mode is a weighted sum of token losses, where each sequence b of the step
gets one weight w_b that depends only on step-wide counts (and on b's own length):

  token-mean               w_b = 1 / T                 T = loss tokens in the whole step
  seq-mean-token-mean      w_b = 1 / (S * n_b)         S = sequences in the step, n_b = b's tokens
  seq-mean-token-sum       w_b = 1 / S
  seq-mean-token-sum-norm  w_b = 1 / (S * C)           C = a constant length (Dr.GRPO, arXiv 2503.20783)

step_loss = sum_b w_b * sum_t loss[b, t] * mask[b, t]

Because T and S are counted over the whole step before the first backward (StepNormalizer,
built by the step plan), each micro-batch's share is exact and the shares add up to the
full-batch loss for any split into micro-batches and ranks. Averaging per-micro-batch means
instead ("mean of means", OpenRLHF <= 0.9.10, fixed in its PR #1249; HF Transformers #34191;
verl PR #3994) over-weights micro-batches with few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class StepNormalizer:
    """Step-wide counts that fix every sequence's weight before the first backward."""

    mode: str
    num_tokens: int
    num_seqs: int
    norm_len: float | None = None

    def __post_init__(self):
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation '{self.mode}'; choose one of {', '.join(AGG_MODES)}")
        if self.mode == "seq-mean-token-sum-norm" and not self.norm_len:
            raise ValueError("seq-mean-token-sum-norm needs a constant length normaliser (train.loss_agg_norm)")
        if self.num_tokens <= 0 or self.num_seqs <= 0:
            raise ValueError(f"a step with {self.num_seqs} sequences and {self.num_tokens} loss tokens has nothing to "
                             "learn from")

    def total_weight(self) -> float:
        """sum over the step of w_b * n_b (sequences always have at least one loss token)."""
        if self.mode in ("token-mean", "seq-mean-token-mean"):
            return 1.0
        if self.mode == "seq-mean-token-sum":
            return self.num_tokens / self.num_seqs
        return self.num_tokens / (self.num_seqs * self.norm_len)

    def sequence_weights(self, seq_tokens: torch.Tensor) -> torch.Tensor:
        """w_b for sequences with ``seq_tokens[b]`` loss tokens (float64 for exact shares)."""
        n = seq_tokens.to(torch.float64)
        if self.mode == "token-mean":
            return torch.full_like(n, 1.0 / self.num_tokens)
        if self.mode == "seq-mean-token-mean":
            # A sequence with no loss tokens contributes nothing (its token sum is 0).
            return 1.0 / (self.num_seqs * n.clamp(min=1))
        if self.mode == "seq-mean-token-sum":
            return torch.full_like(n, 1.0 / self.num_seqs)
        return torch.full_like(n, 1.0 / (self.num_seqs * self.norm_len))


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """This micro-batch's share of the step loss: sum_b w_b sum_t loss[b,t] mask[b,t].

    ``token_losses`` and ``mask`` are [batch, time]; ``mask`` is 1 on tokens that count.
    """
    mask = mask.to(token_losses.dtype)
    seq_sums = (token_losses * mask).sum(dim=-1)
    weights = norm.sequence_weights(mask.sum(dim=-1)).to(token_losses.dtype)
    return (seq_sums * weights).sum()


def canary_share(mask: torch.Tensor, norm: StepNormalizer) -> float:
    """This micro-batch's fraction of the step's total loss weight, sum_b w_b n_b / sum_step w_b n_b.

    The shares of a step's micro-batches add up to exactly 1 when each is counted once under
    the step's one normaliser; the canary (exactrl/checks/canary.py) checks that the optimizer
    sees a gradient of exactly that sum.
    """
    n = mask.sum(dim=-1).to(torch.float64)
    return float((norm.sequence_weights(n) * n).sum() / norm.total_weight())


def micro_batch_normalizer(norm: StepNormalizer, mask: torch.Tensor, micro_batches: int) -> StepNormalizer | None:
    """The mean-of-means bug, reproduced on purpose (fault.mean_of_means, exactrl/config/faults.py): ``norm``'s
    mode counted over this micro-batch's ``mask`` alone, then averaged over the step's
    ``micro_batches`` (all ranks), as OpenRLHF <= 0.10.2 computed each micro-batch's loss (its own
    token mean) and let DeepSpeed divide by the accumulation steps and average over ranks.
    Multiplying the micro-batch's counts by ``micro_batches`` gives every mode exactly w_b / M:
    token-mean 1 / (M T_mb), seq-mean-token-mean 1 / (M S_mb n_b), seq-mean-token-sum 1 / (M S_mb),
    -norm 1 / (M S_mb C). None when the micro-batch has none of the normaliser's tokens (it adds nothing)."""
    n = mask.sum(dim=-1)
    tokens, seqs = int(n.sum()), int((n > 0).sum())
    if tokens == 0:
        return None
    return StepNormalizer(norm.mode, tokens * micro_batches, seqs * micro_batches, norm.norm_len)


# A loss defined per unit of the step plan (a preference pair: plan_step's ``unit`` consecutive samples), not per token.
UNIT_MEAN = "unit-mean"


@dataclass(frozen=True)
class UnitNormalizer:
    """The step-wide normaliser of a loss per unit: step_loss = sum over the step's units of l_u / U, U = the
    units in the whole step (all micro-batches, all ranks; the plan counts them before the first backward).
    TRL's and OpenRLHF's DPO-family and reward-model losses take each micro-batch's mean over its own pairs and
    divide it by the accumulation steps (and the ranks): the same only when every micro-batch holds as many pairs."""

    num_units: int
    mode = UNIT_MEAN

    def __post_init__(self):
        if self.num_units <= 0:
            raise ValueError(f"a step with {self.num_units} units (preference pairs) has nothing to learn from")


def aggregate_units(unit_losses: torch.Tensor, norm: UnitNormalizer) -> torch.Tensor:
    """This micro-batch's share of the step loss: the sum of its units' losses [U_mb] over the step's units."""
    return unit_losses.sum() / norm.num_units


def unit_share(units: int, norm: UnitNormalizer) -> float:
    """This micro-batch's canary share: its units over the step's (the shares of a step sum to exactly 1)."""
    return units / norm.num_units


def micro_batch_units(units: int, micro_batches: int) -> UnitNormalizer | None:
    """The peers' per-micro-batch mean over pairs, reproduced on purpose (fault.mean_of_means): this micro-batch's
    ``units`` averaged, then divided by the step's ``micro_batches`` (all ranks), as TRL's and OpenRLHF's DPO and
    RM trainers let gradient accumulation and DDP do. None when the micro-batch has no unit (it adds nothing)."""
    return UnitNormalizer(units * micro_batches) if units else None
