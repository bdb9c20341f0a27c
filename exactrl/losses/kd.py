"""Offline knowledge distillation (`exactrl kd`) as a term of the objective: at every loss token of an SFT
sample, a divergence between a frozen teacher's next-token distribution and the student's
(exactrl/losses/distill.py), beside SFT's NLL. Both are token losses under one normaliser (same samples, same
tokens, train.loss_agg), so the step's loss is

    sum over the step's loss tokens of [(1 - alpha) NLL + alpha D(p_T, p_S)] / (the step's normaliser)

for any split into micro-batches and ranks. The peers normalise per micro-batch: OpenRLHF's KDLoss divides by
each micro-batch's loss tokens (openrlhf/models/loss.py), TRL's GKD by each micro-batch's ("batchmean" over its
masked tokens, trl/experimental/gkd/gkd_trainer.py).

The teacher's side is per-token data of the step's samples (Sample.teacher_logits, or the top-k log-probs and
ids for topk_forward_kl) computed by the teacher worker before the step (exactrl/algorithms/kd.py); the
student's is its logits at the same targets of the same ids: the two align token by token by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from exactrl.losses.distill import divergence, topk_forward_kl_from_logprobs
from exactrl.losses.objective import NLLTerm, Objective, Term

# The teacher's per-token fields each kd.loss reads (exactrl/workers/teacher.py computes them).
TEACHER_FIELDS = {"forward_kl": ("logits",), "reverse_kl": ("logits",), "jsd": ("logits",),
                  "topk_forward_kl": ("topk_logprobs", "topk_ids")}


@dataclass(frozen=True, kw_only=True)
class KDTerm(Term):
    """The divergence ``loss`` (a key of TEACHER_FIELDS) to the teacher at each loss token, both distributions
    at ``temperature``; ``beta``: jsd's. Logs its mean over the step's loss tokens as kd_divergence."""

    kind = "kd"
    fields: tuple[str, ...] = ("logits",)
    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.loss not in TEACHER_FIELDS:
            raise ValueError(f"a kd term's loss is one of {', '.join(TEACHER_FIELDS)}, not '{self.loss}'")

    def token_loss(self, f, b, mask, m):
        if self.loss == "topk_forward_kl":  # the teacher's top-k are already at the temperature (Teacher.token_field)
            tok = topk_forward_kl_from_logprobs(b["teacher_topk_logprobs"], b["teacher_topk_ids"], f["logits"],
                                                self.temperature)
        else:
            tok = divergence(self.loss, b["teacher_logits"], f["logits"], temperature=self.temperature, beta=self.beta)
        m.mean("kd_divergence", tok.detach(), mask)
        return tok


def kd_objective(loss: str, alpha: float, *, temperature: float, beta: float, agg: str,
                 norm_len: float | None) -> Objective:
    """(1 - alpha) NLL + alpha KD on every loss token, one normaliser (alpha = 1: the KD term alone)."""
    kd = KDTerm(loss=loss, coef=alpha, beta=beta, temperature=temperature, agg=agg, norm_len=norm_len)
    nll = (NLLTerm(coef=1.0 - alpha, agg=agg, norm_len=norm_len),) if alpha < 1 else ()
    return Objective((*nll, kd))

