"""KTO (Ethayarajh et al. 2024, arXiv 2402.01306) as a term of the objective: each unpaired row a unit of
one sample, its loss normalised over the **step's** rows (every micro-batch, every rank), against a reference
point z computed over the **step's** mismatched pairs, so the update does not depend on the micro-batch size
or the world size.

A row is a sample whose source says its label (data/preference.py UnpairedExample.sample): "chosen" for a
desirable completion, "rejected" for an undesirable one. With r = (policy - reference) log-prob summed over
the row's completion tokens, its loss is losses/preference.py ``kto_losses``: w_d (1 - sigma(beta (r - z)))
or w_u (1 - sigma(beta (z - r))).

z = max(0, mean over KL rows of (policy - reference)), the KL rows being mismatched pairs: each row's prompt
with another row's completion. TRL (trl/trainer/kto_trainer.py at f2cd5771) builds them by rotating the
completions by one within each block of per_device_train_batch_size rows of the (sequentially sampled)
dataset, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}) (lines 1096-1111), scores them with the policy without a
graph and the reference, and takes each micro-batch's mean, averaged over the ranks' current micro-batches
(``gather_for_metrics(kl).mean().clamp(min=0)``, lines 1553-1554): z changes with the micro-batch size and
the world size, and so does the objective (TRL #2554, HALOs #35). Here:

* z="step" (the default): the same rotation over the step's rows in the step's order (which no micro-batch
  size or world size changes), scored in a no-grad pre-pass over the step's micro-batches on every rank,
  gathered, one z for the whole step; the loop sets it on the term (``Objective.with_term("kto", z=...)``).
* z="micro_batch" (the peers', to compare): the rotation within each micro-batch, and z of accumulation
  step j the mean over ranks of each rank's j-th micro-batch's mean, clamped at 0, as TRL computes it; each
  row carries its micro-batch's z (Sample.kto_z) and the term reads it (its ``z`` is None). Only z follows
  the peers here: the losses are still normalised over the step's rows (the peers' per-micro-batch mean of
  the losses is fault.mean_of_means's). A micro-batch of one row is its own KL row (TRL refuses that size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.data.batch import Sample
from exactrl.losses.aggregation import UNIT_MEAN
from exactrl.losses.objective import Metrics, Term
from exactrl.losses.pairs import PAIR_SOURCES
from exactrl.losses.preference import kto_losses, kto_reference_point

Z_MODES = ("step", "micro_batch")


@dataclass(frozen=True, kw_only=True)
class KTOTerm(Term):
    """KTO's loss per row (``unit_loss``: one per chosen/rejected sample of the micro-batch), normalised over the
    step's rows (plan the step with unit=1: a unit=2 plan counts half the rows and the canary reads 2). ``z``: the
    step's reference point, set by the loop each step; None reads each row's own ``kto_z`` (z="micro_batch").
    Metrics, means over the step's rows of each label: chosen_reward / rejected_reward (beta r), kto_z."""

    kind = "kto"
    fields: tuple[str, ...] = ("logprobs",)
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    z: float | None = None
    sources: tuple[str, ...] | None = PAIR_SOURCES
    agg: str = UNIT_MEAN

    def __post_init__(self):
        super().__post_init__()
        if self.sources != PAIR_SOURCES or self.agg != UNIT_MEAN or self.weight is not None or self.norm_len:
            raise ValueError(f"a KTO term applies to the sources {PAIR_SOURCES} (desirable, undesirable) with "
                             f"agg='{UNIT_MEAN}' and no per-token weight or norm_len; got sources={self.sources}, "
                             f"agg='{self.agg}', weight={self.weight}, norm_len={self.norm_len}")

    def token_loss(self, f, b, mask, m):
        raise TypeError("a KTO term's loss is per row (unit_loss), not per token")

    def unit_loss(self, f: dict, b: dict, rows: torch.Tensor, sources: list[str], m: Metrics) -> torch.Tensor:
        """One loss per chosen/rejected row of this micro-batch [N] (``rows``: their loss mask)."""
        keep = [i for i, s in enumerate(sources) if s in PAIR_SOURCES]
        idx = torch.tensor(keep, dtype=torch.long, device=rows.device)
        if "ref_logprobs" not in b:
            raise ValueError("the KTO term needs the reference's log-probs (ref_logprobs) of every row: compute "
                             "them with the reference worker before the step")
        mask = rows.to(f["logprobs"].dtype)[idx]
        policy = (f["logprobs"][idx] * mask).sum(-1)
        ref = (b["ref_logprobs"][idx].to(mask.dtype) * mask).sum(-1)
        z = b["kto_z"][idx].to(mask.dtype) if self.z is None else torch.full_like(policy, self.z)
        desirable = torch.tensor([sources[i] == "chosen" for i in keep], device=rows.device)
        loss = kto_losses(policy, ref, desirable, z, self.beta, self.desirable_weight, self.undesirable_weight)
        with torch.no_grad():
            reward = self.beta * (policy - ref)
            m.mean("chosen_reward", reward, desirable.double())
            m.mean("rejected_reward", reward, (~desirable).double())
            m.mean("kto_z", z.detach(), torch.ones_like(reward, dtype=torch.float64))
        return loss


def mismatched(samples: list[Sample], groups: list[list[int]]) -> list[Sample]:
    """The KL rows of ``samples`` (one each, aligned with them): within each group (indices, in order) row
    g[k]'s prompt with row g[k-1]'s completion, the first with the last's (TRL's rotation by one). Each KL row's
    loss mask is its completion's tokens, as the row's own."""
    out: list[Sample | None] = [None] * len(samples)
    for g in groups:
        for k, i in enumerate(g):
            s, other = samples[i], samples[g[k - 1]]
            out[i] = Sample(list(s.prompt_ids), list(other.response_ids), source=s.source)
    missing = [i for i, s in enumerate(out) if s is None]
    if missing:
        raise ValueError(f"KTO's KL rows: samples {missing[:8]} are in no group")
    return out


def kl_gaps(kl_rows: list[Sample], policy: list[torch.Tensor], ref: list[torch.Tensor]) -> torch.Tensor:
    """Each KL row's policy - reference log-prob, summed over its completion tokens, in float64 [N]."""
    def total(values: torch.Tensor, s: Sample) -> torch.Tensor:
        return (values.double() * torch.tensor(s.loss_mask, dtype=torch.float64)).sum()

    return torch.stack([total(p, s) - total(q, s) for s, p, q in zip(kl_rows, policy, ref)])


def step_z(gaps: torch.Tensor) -> float:
    """The step's z: max(0, mean of every KL row's gap)."""
    return float(kto_reference_point(gaps, torch.zeros_like(gaps)))


def micro_batch_z(gaps: torch.Tensor, micro_batches: tuple[tuple[int, ...], ...], world_size: int) -> list[float]:
    """The peers' z for each sample: micro-batch c runs on rank c % world_size as that rank's accumulation step
    c // world_size; TRL's z at that step is the mean over the ranks of their micro-batch's mean gap, clamped."""
    z = [0.0] * len(gaps)
    for start in range(0, len(micro_batches), world_size):
        step = micro_batches[start : start + world_size]
        value = max(0.0, sum(float(gaps[list(mb)].mean()) for mb in step) / len(step))
        for mb in step:
            for i in mb:
                z[i] = value
    return z
