"""On-policy distillation as a term of the objective (exactrl/losses/objective.py): a per-token divergence
between the student (the policy being trained) and a frozen teacher, on the tokens the student sampled. The
teacher's side is per-token data fixed for the rollout (exactrl/algorithms/distill.py computes it once, like
the reference's log-probs); the divergences themselves are exactrl/losses/distill.py's.

Two gradient semantics, as the sources train them:
* ``k1`` -- Thinking Machines' on-policy distillation (Lu et al. 2025, tinker-cookbook's
  ``incorporate_kl_penalty`` with ``kl_discount_factor=0`` and the ``importance_sampling`` loss): the
  sampled-token reverse KL k1 = log p_old(y) - log p_T(y), fixed for the rollout and detached, is each token's
  negative advantage, trained through the unclipped ratio r = p(y) / p_old(y): loss r * k1, gradient
  k1 * grad log p(y) at r = 1. Only the token's own KL is its advantage (discount 0): E[k1 grad log p] is the
  gradient of the reverse KL at each position, with no credit to the later positions a token changes.
* every other loss is differentiated directly, no ratio: ``k3`` as GRPO's KL term (its expected gradient is
  the forward KL's, losses/distill.py), ``reverse_kl``, ``jsd`` (GKD, Agarwal et al. 2024, with lambda = 1:
  only on-policy samples) and ``forward_kl_topk`` over the student's whole next-token distribution at each
  sampled position -- the teacher's logits (or its top-k log-probs and ids) at those positions, never a
  gradient through the teacher.

The term applies to the policy's own sampled tokens (source on_policy, origin policy): a demonstration a
mixed-policy method shows is not the student's sample. Its normaliser counts those tokens over the whole step
and every rank, under the run's aggregation, like every other term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.losses.distill import divergence, reverse_kl_k1, reverse_kl_k3, topk_forward_kl_from_logprobs
from exactrl.losses.objective import Term

# Each distill.loss: the student's per-token field its loss differentiates (Worker.token_field), and the
# teacher's per-rollout fields it reads besides the sampled token's log-prob (Sample.teacher_*).
STUDENT_FIELD = {"k1": "logprobs", "k3": "logprobs", "reverse_kl": "logits", "jsd": "logits",
                 "forward_kl_topk": "logits"}
TEACHER_FIELDS = {"k1": (), "k3": (), "reverse_kl": ("logits",), "jsd": ("logits",),
                  "forward_kl_topk": ("topk_logprobs", "topk_ids")}


@dataclass(frozen=True, kw_only=True)
class DistillTerm(Term):
    """A distillation term: ``loss`` one of STUDENT_FIELD's keys (module docstring); ``beta`` GKD's for jsd;
    ``temperature`` the rollout's, at which the student's logits are read (the teacher's fields already are)."""

    kind = "distill"
    loss: str = "k1"
    beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.loss not in STUDENT_FIELD:
            raise ValueError(f"a distillation term's loss is one of {', '.join(STUDENT_FIELD)}, not '{self.loss}'")
        if self.fields != distill_fields(self.loss):
            raise ValueError(f"a {self.loss} distillation term reads {distill_fields(self.loss)}; make it with "
                             "distill_term()")

    def token_loss(self, f, b, mask, m):
        logp, teacher = f["logprobs"], b["teacher_logprobs"]
        with torch.no_grad():  # the sampled-token reverse KL under the current student, logged for every loss
            m.mean("distill/reverse_kl_k1", reverse_kl_k1(logp, teacher), mask)
        if self.loss == "k1":
            # the rollout's student: its old pass, or (one update per rollout, no old pass) this forward itself
            old = b["old_logprobs"] if "old_logprobs" in b else logp.detach()
            advantage = -reverse_kl_k1(old, teacher).detach()
            ratio = torch.exp(logp - old)
            return -ratio * advantage
        if self.loss == "k3":
            return reverse_kl_k3(logp, teacher)
        if self.loss == "forward_kl_topk":
            return topk_forward_kl_from_logprobs(b["teacher_topk_logprobs"], b["teacher_topk_ids"], f["logits"],
                                                 self.temperature)
        name = "reverse_kl" if self.loss == "reverse_kl" else "jsd"
        return divergence(name, b["teacher_logits"], f["logits"], temperature=self.temperature, beta=self.beta)


def distill_fields(loss: str) -> tuple[str, ...]:
    """The student's per-token fields a ``loss`` term reads: the sampled token's log-prob (for the logged KL, and
    k1/k3's loss), and the logits where the loss is over the whole distribution."""
    return tuple(dict.fromkeys(("logprobs", STUDENT_FIELD[loss])))


def distill_term(loss: str, coef: float, *, temperature: float, beta: float = 0.5, agg: str = "token-mean",
                 norm_len: float | None = None) -> DistillTerm:
    """The distillation term of ``loss`` on the policy's own samples."""
    return DistillTerm(loss=loss, coef=coef, beta=beta, temperature=temperature, fields=distill_fields(loss),
                       sources=("on_policy",), origins=("policy",), agg=agg, norm_len=norm_len)
