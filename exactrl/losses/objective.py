"""A step's loss as declared data: an ``Objective`` is a tuple of terms, each a frozen dataclass
(picklable: a controller can send it to a worker it holds only a handle to), and this module
turns it, from one forward per micro-batch, into the micro-batch's exact share of the step loss.

A term names the per-token loss it computes (policy surrogate, KL to a reference, entropy
bonus, NLL, value), its coefficient (a constant, a ``Linear`` or ``Cosine`` schedule over
optimizer steps, or a value the loop sets per rollout with ``with_term``, as the adaptive KL
does), an optional per-token weight (token_losses.TOKEN_WEIGHTS, stop-gradient), the samples it
applies to (``sources``), the tokens of theirs it applies to (``origins``: who wrote them, as a
sample declares, data/batch.py) and its aggregation. Terms that share samples, tokens and
aggregation share a normaliser: their token losses are summed (in declaration order) and
aggregated once, as one loss would be. Each normaliser counts its tokens over the whole step
(the plan's per-source, per-origin counts), so every term keeps the one rule of the maths
(aggregation.py) by itself. A term whose samples or tokens a step lacks adds nothing to it; a
step that no term applies to is refused. A term whose loss is per unit of the plan (a preference pair,
losses/pairs.py PairTerm) gives ``unit_loss`` (one loss per unit) and aggregates as "unit-mean": a sum
over the micro-batch's units divided by the step's units (aggregation.UnitNormalizer).

The canary share of a micro-batch is the mean over the step's normalisers of its share under
each: every normaliser's shares sum to exactly 1 over the step, so their mean does too.
Metrics stay tensors (sums and counts, or maxima) until the step ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from exactrl.data.batch import ORIGINS
from exactrl.device import to_device
from exactrl.losses.aggregation import (
    UnitNormalizer,
    aggregate,
    aggregate_units,
    canary_share,
    micro_batch_normalizer,
    micro_batch_units,
    unit_share,
)
from exactrl.losses.policy import PolicyInput, demonstration_loss, get_policy_loss, value_loss
from exactrl.losses.rollout_gap import RolloutGap, correction_weight, measure, policy_tokens, trainer_logprobs
from exactrl.losses.token_losses import TOKEN_WEIGHTS, kl_penalty


@dataclass(frozen=True)
class Linear:
    """A coefficient moved linearly from ``start`` to ``end`` over ``steps`` optimizer steps, then held."""

    start: float
    end: float
    steps: int

    def at(self, step: int) -> float:
        return self.end if step >= self.steps else self.start + (self.end - self.start) * step / self.steps


@dataclass(frozen=True)
class Cosine:
    """A coefficient warmed up linearly from ``start`` to ``peak`` over ``warmup`` optimizer steps,
    then moved along a half cosine from ``peak`` to ``valley`` at step ``steps``, then held
    (CHORD's mu, arXiv 2508.11408). Its complement 1 - mu is the Cosine of the complements."""

    warmup: int
    peak: float
    valley: float
    steps: int
    start: float = 0.0

    def __post_init__(self):
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"a cosine schedule warms up within its steps: warmup={self.warmup}, steps={self.steps}")

    def at(self, step: int) -> float:
        if step < self.warmup:
            return self.start + (self.peak - self.start) * step / self.warmup
        if step >= self.steps:
            return self.valley
        done = (step - self.warmup) / (self.steps - self.warmup)
        return self.valley + (self.peak - self.valley) * 0.5 * (1 + math.cos(math.pi * done))


SCHEDULES = (Linear, Cosine)


@dataclass(frozen=True, kw_only=True)
class Term:
    """One term of the loss. It applies to the samples of ``sources`` and, of those, to the loss
    tokens whose origin is in ``origins`` (data/batch.py ORIGINS: "policy" for what the policy
    sampled, "demonstration" for a text it is shown, such as a demonstration's prefix that the
    policy continues in one sequence); None: every sample, every loss token. Its normaliser counts
    exactly those tokens over the step, and a sequence counts if it has at least one of them."""

    coef: float | Linear | Cosine = 1.0
    weight: str | None = None  # a per-token weight of token_losses.TOKEN_WEIGHTS multiplying the token loss
    sources: tuple[str, ...] | None = None
    origins: tuple[str, ...] | None = None
    agg: str = "token-mean"  # an aggregation mode of aggregation.py
    norm_len: float | None = None  # seq-mean-token-sum-norm's constant length
    kind = ""
    fields: tuple[str, ...] = ()  # per-token fields of the forward it reads (Worker.token_field)

    def __post_init__(self):
        unknown = sorted(set(self.origins or ()) - set(ORIGINS))
        if unknown or self.origins == ():
            raise ValueError(f"a {self.kind or 'loss'} term's origins are some of {', '.join(ORIGINS)} (or None: all), "
                             f"not {self.origins}")
        if self.weight is not None and self.weight not in TOKEN_WEIGHTS:
            raise ValueError(f"a {self.kind or 'loss'} term's weight is one of {', '.join(TOKEN_WEIGHTS)} (or None), "
                             f"not '{self.weight}'")

    def needs(self) -> tuple[str, ...]:
        """The per-token fields this term reads: its loss's and its weight's."""
        return (*self.fields, *(TOKEN_WEIGHTS[self.weight][0] if self.weight else ()))

    def token_loss(self, f: dict, b: dict, mask: torch.Tensor, m: Metrics) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class PolicyTerm(Term):
    """A policy loss of losses/policy.py. ``old``: the log-probs the ratio is taken against,
    the batch's ``old_logprobs``, or "self" (this forward's own, detached: a rollout that feeds
    one update needs no old-log-prob pass); then the ratio metric is taken against the
    generator's ``gen_logprobs``. ``gap``: how the policy's sampled tokens are compared with the
    generator's log-probs and the gap corrected (losses/rollout_gap.py): decoupled, the loss is
    multiplied by the correction's weight; folded, the ratio is taken against the generator's."""

    kind = "policy"
    fields: tuple[str, ...] = ("logprobs",)
    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    old: str = "old_logprobs"
    gap: RolloutGap = field(default_factory=RolloutGap)

    def needs(self) -> tuple[str, ...]:
        # the kept-set log-probs are compared, never differentiated (computed without a graph)
        current = self.old == "self" or self.gap.folded
        return (*super().needs(), *(("kept_logprobs",) if self.gap.kept and current else ()))

    def token_loss(self, f, b, mask, m):
        logp, gap = f["logprobs"], self.gap
        if self.old == "self":
            old = logp.detach()
        elif "old_logprobs" in b:
            old = b["old_logprobs"]
        else:
            raise ValueError("the policy term reads old_logprobs, which this micro-batch's samples do not carry")
        sampled, log_rho = policy_tokens(b, mask), None
        if self.old == "self" or gap.correction != "none":  # trainer against generator, in the generator's convention
            log_rho = trainer_logprobs(gap, f, b, self.old == "self" or gap.folded) - b["gen_logprobs"]
        if gap.folded:  # the generator's log-probs as the ratio's anchor, over the trainer's whole vocabulary
            anchor = b["gen_logprobs"] + (logp.detach() - trainer_logprobs(gap, f, b, True))
            old = torch.where(sampled, anchor, old)
        tok, ratio, clipped = get_policy_loss(self.loss)(
            PolicyInput(logp, old, b["advantages"], mask, self.clip_low, self.clip_high, self.dual_clip))
        if gap.correction != "none":
            weight, corrected = correction_weight(log_rho, sampled, gap)
            tok = tok * weight
            m.mean("rollout_correction/weight", weight, sampled)
            m.mean("rollout_correction/corrected_frac", corrected.double(), sampled)
        with torch.no_grad():
            m.mean("clip_frac", clipped, mask)
            if self.old == "self":  # no old pass: checked against the generator (algo.gen_ratio_tol)
                ratio = torch.exp(log_rho)
            elif gap.folded:  # the loss's ratio starts at the gap; the check stays with the old pass
                ratio = torch.exp(logp.detach() - b["old_logprobs"])
            m.max("ratio_dev", (ratio - 1).abs() * mask)
        return tok


@dataclass(frozen=True, kw_only=True)
class KLTerm(Term):
    """KL(policy || reference) per token, an estimator of token_losses.kl_penalty."""

    kind = "kl"
    fields: tuple[str, ...] = ("logprobs",)
    estimator: str = "k3"

    def token_loss(self, f, b, mask, m):
        kl = kl_penalty(f["logprobs"], b["ref_logprobs"], self.estimator)
        m.mean("kl", kl.detach(), mask)
        return kl


@dataclass(frozen=True, kw_only=True)
class EntropyTerm(Term):
    """An entropy bonus: the token loss is -entropy, so higher entropy lowers the loss."""

    kind = "entropy"
    fields: tuple[str, ...] = ("entropy",)

    def token_loss(self, f, b, mask, m):
        m.mean("entropy", f["entropy"], mask)
        return -f["entropy"]


@dataclass(frozen=True, kw_only=True)
class NLLTerm(Term):
    """Negative log-likelihood per token (SFT)."""

    kind = "nll"
    fields: tuple[str, ...] = ("logprobs",)

    def token_loss(self, f, b, mask, m):
        return -f["logprobs"]


@dataclass(frozen=True, kw_only=True)
class ValueTerm(Term):
    """The critic's 0.5 (V - R)^2, clipped around the rollout's values when ``clip`` (losses/policy.py)."""

    kind = "value"
    fields: tuple[str, ...] = ("values",)
    clip: float | None = None

    def token_loss(self, f, b, mask, m):
        values = f["values"]
        tok = value_loss(values, b["old_values"], b["returns"], self.clip)
        with torch.no_grad():
            m.mean("critic_clip_frac", (value_loss(values, b["old_values"], b["returns"], None) < tok).float(), mask)
            m.mean("value_mean", values.detach(), mask)
        return tok


@dataclass(frozen=True, kw_only=True)
class MixedPolicyTerm(PolicyTerm):
    """LUFFY's policy loss (arXiv 2504.14945, its objective) on a group of on-policy samples and
    demonstrations: the PolicyTerm's loss on the policy's tokens, the shaped demonstration loss
    (losses/policy.py demonstration_loss, f(p) = p / (p + gamma), unclipped) on the
    demonstrations' tokens, and ONE normaliser over both (the paper's 1/Z sums the tokens of every
    trajectory of the group, on- and off-policy). Two terms with their own normalisers would be a
    mean of means across sources: a group's one demonstration would weigh as much as its
    on-policy samples together. The ratio metrics (and so the on-policy check) cover the policy's
    tokens only: a demonstration's ratio is not 1 by construction."""

    gamma: float = 0.1

    def token_loss(self, f, b, mask, m):
        demo = b["origin"] == ORIGINS.index("demonstration")
        on = super().token_loss(f, b, mask * ~demo, m)
        shaped = demonstration_loss(f["logprobs"], b["advantages"], self.gamma)
        m.mean("demo_prob", torch.exp(f["logprobs"].detach()), mask * demo)
        return torch.where(demo, shaped, on)


@dataclass(frozen=True, kw_only=True)
class DemonstrationTerm(Term):
    """The policy-gradient loss on demonstrations, behaviour probability 1 (losses/policy.py
    demonstration_loss): SRFT's demonstration RL term (arXiv 2506.19767), with ``clip``
    = (low, high) PPO's clip on the ratio p, or None. Since p <= 1 only the lower bound acts: a
    demonstration token with a negative advantage stops being pushed down once p < 1 - low.
    ``gamma``: LUFFY's shaping p / (p + gamma) of the ratio (SRFT's official code), None: p."""

    kind = "demo_policy"
    fields: tuple[str, ...] = ("logprobs",)
    clip: tuple[float, float] | None = None
    gamma: float | None = None

    def token_loss(self, f, b, mask, m):
        m.mean("demo_prob", torch.exp(f["logprobs"].detach()), mask)
        return demonstration_loss(f["logprobs"], b["advantages"], gamma=self.gamma, clip=self.clip)


@dataclass(frozen=True, kw_only=True)
class OutcomeTerm(Term):
    """SRFT's self-rollout terms (arXiv 2506.19767), split by the response's reward: on a
    "positive" response (reward >= ``threshold``) the NLL -log p (maximise its likelihood), on a
    "negative" one +log p (minimise it); the other responses' tokens add 0. Both halves sit under
    the on-policy tokens' one normaliser, the paper's expectation over the policy's samples."""

    kind = "outcome"
    fields: tuple[str, ...] = ("logprobs",)
    sign: str = "positive"
    threshold: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.sign not in ("positive", "negative"):
            raise ValueError(f"an outcome term's sign is positive or negative, not {self.sign!r}")

    def token_loss(self, f, b, mask, m):
        positive = (b["reward"] >= self.threshold)[:, None]
        rows = positive if self.sign == "positive" else ~positive
        m.mean(f"{self.sign}_fraction", rows.expand_as(mask).double(), mask)
        return rows.to(f["logprobs"].dtype) * (-f["logprobs"] if self.sign == "positive" else f["logprobs"])


@dataclass(frozen=True)
class Objective:
    terms: tuple[Term, ...]
    metrics: tuple[str, ...] = ()  # per-token fields logged as means even when no term trains on them ("entropy")
    on_policy: object | None = None  # a declared check of the step's max |ratio - 1| (checks/on_policy.py)
    # the rollout-trainer gap to measure in this step's forward (losses/rollout_gap.py): set for the update of a
    # rollout without an old-log-prob pass, whose forward is the rollout's policy
    gap: RolloutGap | None = None

    def fields(self) -> tuple[str, ...]:
        """The per-token fields one forward must produce, in a fixed order."""
        gap = (self.gap.logprob_field(),) if self.gap is not None else ()
        return tuple(dict.fromkeys([*(f for t in self.terms for f in t.needs()), *self.metrics, *gap]))

    def with_gap(self, gap: RolloutGap, measure: bool = False) -> Objective:
        """The objective whose policy terms compare with the generator and correct the gap as
        ``gap`` says; ``measure``: the step's forward also measures the gap (no old-log-prob pass)."""
        return replace(self.with_term("policy", gap=gap), gap=gap if measure else None)

    def at(self, step: int) -> Objective:
        """The objective with every scheduled coefficient resolved at optimizer step ``step``."""
        return replace(self, terms=tuple(replace(t, coef=t.coef.at(step)) if isinstance(t.coef, SCHEDULES) else t
                                         for t in self.terms))

    def with_term(self, kind: str, **changes) -> Objective:
        """The objective with the ``kind`` term changed (e.g. the adaptive KL's coefficient, per rollout)."""
        return replace(self, terms=tuple(replace(t, **changes) if t.kind == kind else t for t in self.terms))

    def groups(self) -> dict[tuple, list[Term]]:
        """Terms by the normaliser they share: (sources, origins, aggregation, constant length)."""
        out: dict[tuple, list[Term]] = {}
        for t in self.terms:
            out.setdefault((t.sources, t.origins, t.agg, t.norm_len), []).append(t)
        return out

    def normalizers(self, plan) -> dict[tuple, object]:
        """Each group's step-wide normaliser; a group whose tokens the step lacks has none (adds
        nothing). A step with no token for any group is refused: its loss would be 0/0."""
        out = {key: plan.normalizer_for(key[2], key[3], key[0], key[1])
               for key in self.groups() if plan.count(key[0], key[1])[0]}
        if not out:
            pairs = dict.fromkeys((c.source, o) for c in plan.counts for o, _ in c.origins)
            has = ", ".join(f"{src}/{o}: {plan.count([src], [o])[0]}" for src, o in pairs) or "none"
            wants = "; ".join(f"{t.kind}: sources {'/'.join(t.sources or ['any'])}, "
                              f"origins {'/'.join(t.origins or ['any'])}" for t in self.terms)
            raise ValueError(f"no term of the objective applies to a loss token of this step (its terms: {wants}; "
                             f"the step's loss tokens by source/origin: {has}): give it samples some term applies to")
        return out


@dataclass
class Metrics:
    """A step's metrics as device tensors: masked sums and counts (means) and maxima."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)

    def mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        mask = mask.to(torch.float64)
        s, n = (values.detach().to(torch.float64) * mask).sum(), mask.sum()
        self.sums[name] = self.sums[name] + s if name in self.sums else s
        self.counts[name] = self.counts[name] + n if name in self.counts else n

    def max(self, name: str, values: torch.Tensor) -> None:
        v = values.detach().to(torch.float64).max()
        self.maxima[name] = torch.maximum(self.maxima[name], v) if name in self.maxima else v

    def result(self) -> dict[str, float]:
        """The means and maxima of this process's values (Worker.train_step reduces them over ranks itself)."""
        return {k: float(s / self.counts[k].clamp(min=1)) for k, s in self.sums.items()} | {
            k: float(v) for k, v in self.maxima.items()}


def _scope(b: dict[str, torch.Tensor], sources: list[str], chosen: tuple[str, ...] | None,
           origins: tuple[str, ...] | None) -> torch.Tensor:
    """``b``'s loss mask restricted to the rows whose source is in ``chosen`` and to the tokens
    whose origin is in ``origins`` (None: every row, every token)."""
    mask = b["loss_mask"]
    if chosen is not None:
        mask = mask * to_device(torch.tensor([s in chosen for s in sources]), mask.device)[:, None]
    if origins is not None:
        mask = mask * torch.isin(b["origin"], to_device(torch.tensor([ORIGINS.index(o) for o in origins]), mask.device))
    return mask


def micro_batch_loss(objective: Objective, f: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                     cpu: dict[str, torch.Tensor], sources: list[str], normalizers: dict[tuple, object],
                     m: Metrics, mean_of: int | None = None) -> tuple[torch.Tensor, float]:
    """This micro-batch's share of the step loss under ``objective`` and its canary share.
    ``f``: the forward's per-token fields; ``b``: the collated batch; ``cpu``: the same on the
    CPU (the canary share is a host number); ``sources``: each row's. ``mean_of``: the step's
    number of micro-batches when fault.mean_of_means replaces each normaliser by this
    micro-batch's own, averaged over them (aggregation.micro_batch_normalizer); each micro-batch
    then weighs 1/mean_of of the step, its canary share."""
    mask = b["loss_mask"]
    loss, shares = None, []
    for key, terms in objective.groups().items():
        norm = normalizers.get(key)
        on_cpu = _scope(cpu, sources, key[0], key[1])
        if norm is None:
            continue
        if isinstance(norm, UnitNormalizer):  # a loss per unit (losses/pairs.py PairTerm), over the step's units
            part, share = _unit_loss(terms, f, b, sources, _scope(b, sources, key[0], key[1]), norm, m, mean_of)
            loss, shares = part if loss is None else loss + part, [*shares, share]
            continue
        if mean_of is not None:  # a micro-batch without this group's tokens adds 0 under either normaliser
            norm = micro_batch_normalizer(norm, on_cpu, mean_of) or norm
        rows = _scope(b, sources, key[0], key[1])
        tok = None
        for t in terms:
            part = t.token_loss(f, b, rows, m)
            if t.weight is not None:
                part = part * TOKEN_WEIGHTS[t.weight][1](f)
            tok = t.coef * part if tok is None else tok + t.coef * part
        part = aggregate(tok, rows, norm)
        loss = part if loss is None else loss + part
        shares.append(canary_share(on_cpu, norm))
    for name in objective.metrics:
        m.mean(name, f[name], mask)
    gap = objective.gap
    if gap is not None and "gen_logprobs" in b:
        measure(f[gap.logprob_field()] - b["gen_logprobs"], policy_tokens(b, mask), gap.gap_cap, m)
    return loss, 1.0 / mean_of if mean_of is not None else sum(shares) / len(shares)


def _unit_loss(terms: list[Term], f: dict, b: dict, sources: list[str], rows: torch.Tensor, norm: UnitNormalizer,
               m: Metrics, mean_of: int | None) -> tuple[torch.Tensor, float]:
    """A group of per-unit terms (each ``unit_loss`` gives one loss per unit of this micro-batch): the sum of their
    weighted losses over the step's units, and this micro-batch's canary share. Under ``mean_of`` (the peers'
    per-micro-batch mean over pairs) a micro-batch without units adds nothing under either normaliser."""
    per_unit = sum(t.coef * t.unit_loss(f, b, rows, sources, m) for t in terms)
    units = per_unit.numel()
    if mean_of is not None:
        norm = micro_batch_units(units, mean_of) or norm
    return aggregate_units(per_unit, norm), unit_share(units, norm)
