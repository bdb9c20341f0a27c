"""The rollout-trainer gap: how far the generator's log-probs of the tokens it sampled are from
the trainer's, measured every rollout, and its correction in the policy loss. Pure per-token
functions, never reduced over the batch: the step's one normaliser does that (aggregation.py).

Notation, per token the policy sampled: delta = log pi_trainer - log pi_gen and rho = exp(delta)
= pi_trainer / pi_gen, both in the generator's convention (over the whole vocabulary, or over
the top-p/top-k kept set replayed on the trainer's logits: exactrl/rollout/generator.py). The
tokens drew from pi_gen, so (Schulman, "Approximating KL divergence", 2020, with r = rho and
samples from q = pi_gen) the estimators below are of KL(pi_gen || pi_trainer):

  rollout_gap/abs_mean, abs_max   mean and max |delta|
  rollout_gap/k1                  mean of -delta (unbiased, may be negative)
  rollout_gap/k3                  mean of rho - 1 - delta (unbiased, >= 0)
  rollout_gap/chi2_token          mean of (rho - 1)^2, chi^2(pi_trainer || pi_gen) per token
  rollout_gap/chi2_seq            mean over sequences of (prod_t rho_t - 1)^2, the same per response
  rollout_gap/outside_frac        share of tokens with rho outside [1/C, C] (C = algo.rollout_gap_cap)

(verl logs E[rho^2] - 1 for chi^2, equal in expectation since E_gen[rho] = 1; on a finite sample
it can go negative, (rho - 1)^2 cannot, and it reads 0 exactly when the two engines agree.)
Only the policy's own tokens count: loss tokens of origin "policy" (data/batch.py): a
demonstration, or a hint the policy continues, was never sampled.

Corrections (algo.rollout_correction), each a stop-gradient weight w(rho) per token:
  tis       w = min(rho, C)                           Yao et al. 2025, truncated IS
  icepop    w = rho if 1/C_low <= rho <= C, else 0    IcePop (arXiv 2510.18855), masked IS
  seq_mask  w = rho if the sequence's geometric-mean rho is in [1/C_low, C], else 0
Decoupled form: loss = w * PPO(pi_theta / pi_old), rho = pi_old / pi_gen (the trainer's own
old log-probs, fixed for the rollout). Folded form: the PPO ratio is taken against the
generator's log-probs, which already carries rho, so the weight is w / rho, with rho =
sg(pi_theta) / pi_gen (as verl's bypass mode). At the first update of a rollout (pi_theta =
pi_old) both give the gradient -w A grad log pi wherever PPO's clip is inactive; they differ in
where the clip acts (around pi_old, or around pi_gen). A masked or truncated token keeps its place
in the normaliser (its weight is 0 or smaller, it is not removed), as the estimators of TIS,
IcePop and masked IS are written -- an expectation over every sampled token -- and as TRL and
OpenRLHF apply them; verl's rejection sampling drops rejected tokens from the normaliser instead.
It is also what keeps the step exact: the normaliser is fixed before the first backward, while a
mask is known only from the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.data.batch import ORIGINS

CORRECTIONS = ("none", "tis", "icepop", "seq_mask")
FORMS = ("decoupled", "folded")
POLICY = ORIGINS.index("policy")
# verl's SAFETY_BOUND (rollout_corr_helper.py): a sequence's summed log-ratio is clamped to +-20 in
# chi2_seq, so one runaway response reads as huge (e^40) rather than inf
SEQ_LOG_BOUND = 20.0


@dataclass(frozen=True)
class RolloutGap:
    """How the trainer compares its log-probs with the generator's and corrects the gap.
    ``kept``: the generator's log-probs are over the top-p/top-k kept set, so the trainer's
    compared with them are too (the forward's field kept_logprobs, the rollout's old_kept_logprobs).
    ``gap_cap``: C of rollout_gap/outside_frac. ``correction``, ``form``, ``cap`` (C) and
    ``cap_low`` (C_low): the correction above (caps resolved, see exactrl/algorithms/registry.py)."""

    kept: bool = False
    gap_cap: float = 2.0
    correction: str = "none"
    form: str = "decoupled"
    cap: float = 2.0
    cap_low: float = 2.0

    def __post_init__(self):
        if self.correction not in CORRECTIONS or self.form not in FORMS:
            raise ValueError(f"a rollout correction is one of {', '.join(CORRECTIONS)} in form "
                             f"{' or '.join(FORMS)}, not {self.correction!r} / {self.form!r}")
        if min(self.gap_cap, self.cap, self.cap_low) <= 1.0:
            raise ValueError(f"the caps of the rollout gap are > 1 (the bands are [1/C, C]): gap_cap={self.gap_cap}, "
                             f"cap={self.cap}, cap_low={self.cap_low}")

    @property
    def folded(self) -> bool:
        return self.correction != "none" and self.form == "folded"

    def logprob_field(self) -> str:
        """The forward's field in the generator's convention."""
        return "kept_logprobs" if self.kept else "logprobs"

    def record(self, generator: str, logprobs_over: str) -> dict:
        """What a run's manifest keeps of it (``rollout_correction.<phase>``; exactrl/audit/recorded.py reads it)."""
        entry = {"correction": self.correction, "generator": generator, "generator_logprobs_over": logprobs_over,
                 "kept_set_replayed": self.kept, "gap_cap": self.gap_cap, "masked_tokens": "stay in the normaliser"}
        if self.correction == "none":
            return entry
        return entry | {"form": self.form, "cap": self.cap} | ({} if self.correction == "tis" else {
            "cap_low": self.cap_low})


def policy_tokens(b: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``mask``'s tokens that the policy sampled (origin "policy"), as a bool [B, T]."""
    return (mask > 0) & (b["origin"] == POLICY)


def trainer_logprobs(gap: RolloutGap, f: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                     current: bool) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens in the generator's convention, without a
    gradient: this forward's (``current``) or the rollout's old-log-prob pass's."""
    if current:
        return f[gap.logprob_field()].detach()
    return b["old_kept_logprobs" if gap.kept else "old_logprobs"]


def measure(delta: torch.Tensor, tokens: torch.Tensor, cap: float, m) -> None:
    """The gap's metrics (module docstring) from ``delta`` [B, T] = trainer - generator log-probs
    over the bool ``tokens``, into ``m`` (objective.Metrics: masked sums and counts, maxima), in float64."""
    d = torch.where(tokens, delta.detach().to(torch.float64), 0.0)
    rho = torch.exp(d)
    m.mean("rollout_gap/abs_mean", d.abs(), tokens)
    m.max("rollout_gap/abs_max", d.abs())
    m.mean("rollout_gap/k1", -d, tokens)
    m.mean("rollout_gap/k3", rho - 1 - d, tokens)
    m.mean("rollout_gap/chi2_token", (rho - 1) ** 2, tokens)
    m.mean("rollout_gap/outside_frac", ((rho < 1 / cap) | (rho > cap)).to(torch.float64), tokens)
    seq = d.sum(1, keepdim=True).clamp(-SEQ_LOG_BOUND, SEQ_LOG_BOUND)
    m.mean("rollout_gap/chi2_seq", (torch.exp(seq) - 1) ** 2, tokens.any(1, keepdim=True))


def correction_weight(log_rho: torch.Tensor, tokens: torch.Tensor, gap: RolloutGap) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """The per-token factor the policy loss is multiplied by (1 off ``tokens``; no gradient) and
    the bool tokens the correction truncated or masked. ``log_rho`` [B, T]: log pi_trainer -
    log pi_gen (the old pass's in the decoupled form, this forward's in the folded form)."""
    log_rho = torch.where(tokens, log_rho.detach(), 0.0)
    rho = torch.exp(log_rho)
    if gap.correction == "tis":
        acted = rho > gap.cap
        factor = rho.clamp(max=gap.cap) if gap.form == "decoupled" else (gap.cap / rho).clamp(max=1.0)
    else:
        if gap.correction == "seq_mask":  # the geometric mean of the sequence's token ratios
            n = tokens.sum(1, keepdim=True).clamp(min=1)
            ratio = torch.exp(log_rho.sum(1, keepdim=True) / n).expand_as(rho)
        else:
            ratio = rho
        acted = (ratio < 1 / gap.cap_low) | (ratio > gap.cap)
        factor = (~acted).to(rho.dtype) * (rho if gap.form == "decoupled" else 1.0)
    return torch.where(tokens, factor, torch.ones_like(factor)), acted & tokens
