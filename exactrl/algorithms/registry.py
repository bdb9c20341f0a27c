"""The RL algorithms' code: each method's facts are its row of exactrl/config/methods.py (its
estimator, loss, workers, demonstrations...); here each gets where its rollouts come from and the
loss it trains (``objective``: the terms of exactrl/losses/objective.py it is made of). The loop in
rl.py reads these fields and never an algorithm's name; a new algorithm is a row of METHODS, plus an
entry of CODE here when it brings its own rollout or terms (and its estimator or loss in
exactrl/advantages or exactrl/losses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from exactrl.advantages.estimators import TOKEN_REWARDS
from exactrl.algorithms.hint_methods import prefix_rft_advantages, prefix_rft_objective, uft_objective
from exactrl.algorithms.luffy_srft import luffy_terms, srft_terms
from exactrl.algorithms.sft_rl import chord_terms, hpt_terms
from exactrl.config.aggregation import norm_len
from exactrl.config.loader import ConfigError
from exactrl.config.methods import METHODS, Method
from exactrl.losses.distill_terms import distill_term
from exactrl.losses.objective import EntropyTerm, KLTerm, Objective, PolicyTerm
from exactrl.losses.rollout_gap import RolloutGap
from exactrl.registry import Registry
from exactrl.rollout.collect import collect_dynamic_rollout, plain_rollout
from exactrl.rollout.gated import gated, with_demonstrations
from exactrl.rollout.hinted import prefix_rft_rollout, uft_rollout
from exactrl.rollout.mixed import mixed_rollout


@dataclass(frozen=True)
class Algorithm:
    """A method's code, attached to its row of exactrl/config/methods.py (which holds every fact about
    it: its estimator, loss, critic, demonstrations...); ``algorithm.critic`` reads the row."""

    method: Method
    rollout: Callable = plain_rollout  # (generator, prompts, indices, rollout, rewards, cfg) -> (samples, stats)
    # the method's own objective made from the standard one: (objective, cfg) -> objective (None: the standard)
    reshape: Callable | None = None
    # replaces the estimator's advantages after it ran: (samples, rewards, cfg) -> None (None: keeps them)
    reshape_advantages: Callable | None = None

    def __getattr__(self, fact: str):
        if fact.startswith("__") or fact == "method":  # copy and pickle probe before ``method`` is set
            raise AttributeError(fact)
        return getattr(self.method, fact)

    def objective(self, cfg) -> Objective:
        """The policy's loss as data: the clipped surrogate (against the batch's old log-probs;
        the loop switches a rollout that skips that pass to "self", see PolicyTerm; none for a method whose
        objective is distillation alone), the distillation term with distill.teacher, the KL to the
        reference unless it is in the reward (then the estimator must declare how it reads it: a KL
        never lands nowhere), the entropy bonus.
        The entropy metric is free with an entropy term; without one it costs a pass over every
        micro-batch's logits (a softmax over the vocabulary), so it is logged only on request (algo.log_entropy)."""
        a, t = cfg.algo, cfg.train
        agg = {"agg": t.loss_agg, "norm_len": norm_len(cfg)}
        terms = [PolicyTerm(loss=a.policy_loss or self.policy_loss, clip_low=a.clip_eps,
                            clip_high=a.clip_eps_high or a.clip_eps, dual_clip=a.dual_clip, **agg)
                 ] if self.policy_term else []
        d = cfg.distill
        if d.teacher is not None:  # on-policy distillation's term on the policy's samples (distill.*)
            terms.append(distill_term(d.loss, d.coef, temperature=cfg.rollout.temperature, beta=d.beta, **agg))
        if a.kl_coef > 0 and a.kl_in_reward and self.advantage not in TOKEN_REWARDS:
            raise ConfigError(f"algo.kl_in_reward=true: algo.name={self.name}'s estimator '{self.advantage}' does not "
                              "read per-token rewards, so the KL would land nowhere; set algo.kl_in_reward=false")
        if a.kl_coef > 0 and not a.kl_in_reward:
            terms.append(KLTerm(coef=a.kl_coef, estimator=a.kl_estimator, **agg))
        if a.entropy_coef > 0:
            terms.append(EntropyTerm(coef=a.entropy_coef, **agg))
        objective = Objective(tuple(terms), metrics=("entropy",) if a.log_entropy and a.entropy_coef == 0 else ())
        return (self.reshape(objective, cfg) if self.reshape else objective).with_gap(gap_spec(cfg))


# Each correction's caps (C, C_low) when algo.rollout_correction_cap(_low) are unset, from its source
# (config/schema_rl.py states them): TIS truncates from above only, its C_low is never read.
CORRECTION_CAPS = {"none": (2.0, 2.0), "tis": (2.0, 2.0), "icepop": (5.0, 2.0), "seq_mask": (3.0, None)}


def gap_spec(cfg, kept: bool = False) -> RolloutGap:
    """How the policy's sampled tokens are compared with the generator's log-probs and the gap
    corrected (exactrl/losses/rollout_gap.py), from algo.rollout_correction* and algo.rollout_gap_cap;
    ``kept``: the generator's log-probs are over the top-p/top-k kept set (rollout/generator.py)."""
    a = cfg.algo
    cap, cap_low = CORRECTION_CAPS[a.rollout_correction]
    cap = a.rollout_correction_cap or cap
    return RolloutGap(kept=kept, gap_cap=a.rollout_gap_cap, correction=a.rollout_correction,
                      form=a.rollout_correction_form, cap=cap, cap_low=a.rollout_correction_cap_low or cap_low or cap)


def on_terms(make: Callable) -> Callable:
    """A reshape from ``make(terms, cfg) -> terms``."""
    return lambda base, cfg: replace(base, terms=tuple(make(list(base.terms), cfg)))


def policy_replaced_by(make: Callable) -> Callable:
    """A reshape putting ``make(cfg, aggregation)``'s terms in place of the standard policy term
    (its aggregation; the KL and entropy terms stay)."""
    def reshape(base: Objective, cfg) -> Objective:
        terms = []
        for t in base.terms:
            terms += make(cfg, {"agg": t.agg, "norm_len": t.norm_len}) if t.kind == "policy" else [t]
        return replace(base, terms=tuple(terms))
    return reshape


# Each method's code where it is not the default (plain_rollout, the standard objective); its facts are its row.
CODE = (
    Algorithm(METHODS["dapo"], rollout=collect_dynamic_rollout),
    Algorithm(METHODS["luffy"], rollout=mixed_rollout, reshape=policy_replaced_by(luffy_terms)),
    Algorithm(METHODS["srft"], rollout=mixed_rollout, reshape=policy_replaced_by(srft_terms)),
    Algorithm(METHODS["chord"], rollout=with_demonstrations, reshape=on_terms(chord_terms)),
    Algorithm(METHODS["hpt"], rollout=gated, reshape=on_terms(hpt_terms)),
    Algorithm(METHODS["uft"], rollout=uft_rollout, reshape=uft_objective),
    Algorithm(METHODS["prefix_rft"], rollout=prefix_rft_rollout, reshape=prefix_rft_objective,
              reshape_advantages=prefix_rft_advantages),
)
ALGORITHMS: Registry[Algorithm] = Registry("algo.name")
for method in METHODS.values():
    ALGORITHMS.add(method.name, next((a for a in CODE if a.method is method), Algorithm(method)))
