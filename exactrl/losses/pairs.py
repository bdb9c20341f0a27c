"""A preference pair as a unit of the objective: a pairwise loss (the DPO family, Bradley-Terry) is a
sum over the step's pairs divided by the number of pairs in the **whole step** (all micro-batches,
all ranks), so the micro-batches' losses add up to the step's mean over pairs whatever the split.

TRL's and OpenRLHF's DPO, IPO, SimPO and reward-model losses are a mean over each micro-batch's
pairs, then divided by the accumulation steps (and averaged over ranks): the full-batch loss only
when every micro-batch on every rank holds the same number of pairs (not with a last partial batch,
token-budget batching or uneven ranks). That form is kept only to compare (fault.mean_of_means,
aggregation.micro_batch_units).

The rows of a pair are two consecutive samples, chosen then rejected (sources "chosen" and
"rejected", data/batch.py), which a plan made with ``unit=2`` never splits (distributed/step_plan.py):

    samples = [s for pair in pairs for s in pair.samples()]  # data/preference.py PairExample: chosen, rejected
    plan = plan_samples(samples, micro_batch_size, "token-mean", world_size=world, unit=2)
    objective = Objective((PairTerm(loss="dpo", params=PairParams(beta=0.1)),  # DPO
                           NLLTerm(sources=("chosen",), coef=alpha)))  # + RPO's NLL, over the step's chosen tokens
    worker.train_step(samples, plan, objective)

A term here only reduces each row's per-token log-probs (and the reference's, ``ref_logprobs``) to
sums over its loss tokens; the loss itself is a pure function of those sums
(losses/preference.py PAIR_LOSSES).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exactrl.losses.aggregation import UNIT_MEAN
from exactrl.losses.objective import Metrics, Term
from exactrl.losses.preference import PAIR_LOSSES, PairInput, PairParams

PAIR_SOURCES = ("chosen", "rejected")


def pair_rows(sources: list[str]) -> tuple[list[int], list[int]]:
    """The micro-batch rows of each pair's chosen and rejected answer: its chosen/rejected rows, in order, must
    alternate chosen, rejected (what a plan with ``unit=2`` over pairs laid out so keeps together)."""
    rows = [i for i, s in enumerate(sources) if s in PAIR_SOURCES]
    chosen, rejected = rows[0::2], rows[1::2]
    if len(chosen) != len(rejected) or any(sources[i] != "chosen" for i in chosen) or any(
            sources[i] != "rejected" for i in rejected):
        raise ValueError(f"a pair term reads a micro-batch's chosen/rejected rows as consecutive pairs, chosen first; "
                         f"got {[sources[i] for i in rows][:8]}: lay each pair out as two consecutive samples and "
                         "plan the step with unit=2")
    return chosen, rejected


@dataclass(frozen=True, kw_only=True)
class PairTerm(Term):
    """A pairwise loss of losses/preference.py PAIR_LOSSES (``loss``, with ``params``) on the step's
    preference pairs, normalised over all pairs of the step (aggregation.UnitNormalizer). Its metrics,
    means over the step's pairs: every per-pair value the loss returns (chosen_reward, rejected_reward...),
    the reward margin and the accuracy (chosen reward above rejected)."""

    kind = "pair"
    fields: tuple[str, ...] = ("logprobs",)
    loss: str = "dpo"
    params: PairParams = field(default_factory=PairParams)
    sources: tuple[str, ...] | None = PAIR_SOURCES
    agg: str = UNIT_MEAN

    def __post_init__(self):
        super().__post_init__()
        PAIR_LOSSES.lookup(self.loss)
        if self.sources != PAIR_SOURCES or self.agg != UNIT_MEAN or self.weight is not None or self.norm_len:
            raise ValueError(f"a pair term applies to the sources {PAIR_SOURCES} with agg='{UNIT_MEAN}' and no "
                             f"per-token weight or norm_len; got sources={self.sources}, agg='{self.agg}', "
                             f"weight={self.weight}, norm_len={self.norm_len}")

    def token_loss(self, f, b, mask, m):
        raise TypeError("a pair term's loss is per pair (unit_loss), not per token")

    def unit_loss(self, f: dict, b: dict, rows: torch.Tensor, sources: list[str], m: Metrics) -> torch.Tensor:
        """One loss per pair of this micro-batch [P]: ``rows`` is the loss mask of its chosen/rejected rows."""
        spec = PAIR_LOSSES[self.loss]
        chosen, rejected = (torch.tensor(r, dtype=torch.long, device=rows.device) for r in pair_rows(sources))
        loss, extra = spec.fn(self.pair_input(f, b, rows, chosen, rejected), self.params)
        with torch.no_grad():
            every = torch.ones_like(loss, dtype=torch.float64)
            for name, values in extra.items():
                m.mean(name, values, every)
            if "chosen_reward" in extra and "rejected_reward" in extra:
                margin = extra["chosen_reward"] - extra["rejected_reward"]
                m.mean("reward_margin", margin, every)
                m.mean("reward_accuracy", (margin > 0).double(), every)
        return loss

    def pair_input(self, f: dict, b: dict, rows: torch.Tensor, chosen: torch.Tensor,
                   rejected: torch.Tensor) -> PairInput:
        """The loss's per-pair input: each row's log-probs (and the reference's) summed over its loss tokens."""
        spec = PAIR_LOSSES[self.loss]
        mask = rows.to(f["logprobs"].dtype)
        sums, tokens = (f["logprobs"] * mask).sum(-1), mask.sum(-1)
        ref = None
        if spec.needs_reference:
            if "ref_logprobs" not in b:
                raise ValueError(f"the {self.loss} pair loss needs the reference's log-probs (ref_logprobs) of every "
                                 "chosen and rejected sample: compute them with the reference worker before the step")
            ref = (b["ref_logprobs"].to(mask.dtype) * mask).sum(-1)
        return PairInput(chosen=sums[chosen], rejected=sums[rejected], chosen_tokens=tokens[chosen],
                         rejected_tokens=tokens[rejected], ref_chosen=None if ref is None else ref[chosen],
                         ref_rejected=None if ref is None else ref[rejected])


def last_token_scores(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each row's score [B] at its answer's last token: ``scores`` [B, L-1] holds at target t the head's output at
    target t's own token (Worker field "scores", workers/reward_model.py), ``rows`` [B, L-1] the loss mask, so the
    last target it marks is the answer's last real token (its EOS), wherever padding, packing or a pad id equal to
    EOS put other tokens. Found from the mask, never by looking for a pad id: with pad = eos the first "pad" can be
    an end of turn inside the prompt, and the last non-pad token is the one before the answer's EOS."""
    width = rows.size(-1)
    if not bool((rows > 0).any(-1).all()):
        raise ValueError("a reward model scores a sequence at its answer's last token, but a row has no loss token "
                         "(an empty answer): drop the pair or shorten its prompt")
    last = width - 1 - (rows > 0).flip(-1).to(torch.uint8).argmax(-1)
    return scores.gather(-1, last[:, None])[:, 0]


@dataclass(frozen=True, kw_only=True)
class ScoreTerm(PairTerm):
    """A reward model's pair loss (``loss="bt"``, Bradley-Terry): each answer's reward is the scalar head's output at
    its answer's last real token (last_token_scores), not a sum of log-probs. ``margin``: subtract each pair's margin
    column (the samples' ``margin``, data/preference.py); off, the column is not read."""

    kind = "pair"
    fields: tuple[str, ...] = ("scores",)
    loss: str = "bt"
    margin: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.loss != "bt":
            raise ValueError(f"a score term trains a reward model with the 'bt' loss, not '{self.loss}'")

    def pair_input(self, f, b, rows, chosen, rejected) -> PairInput:
        c, r = (last_token_scores(f["scores"][i], rows[i]) for i in (chosen, rejected))
        tokens = rows.sum(-1).to(c.dtype)
        margin = b["margin"].to(c.dtype)[chosen] if self.margin else None
        return PairInput(chosen=c, rejected=r, chosen_tokens=tokens[chosen], rejected_tokens=tokens[rejected],
                         margin=margin)
