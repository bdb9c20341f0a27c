"""The RL algorithms, one declaration each: what they estimate advantages with, which loss
they train (``objective``: the terms of exactrl/losses/objective.py it is made of), which workers
they need and where their rollouts come from. The loop in rl.py reads these fields and never an
algorithm's name; a new algorithm is a new entry here (plus its estimator or loss in
exactrl/advantages or exactrl/losses when it brings one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from exactrl.advantages.estimators import TOKEN_REWARDS
from exactrl.algorithms.hint_methods import prefix_rft_advantages, prefix_rft_objective, uft_objective
from exactrl.algorithms.luffy_srft import luffy_terms, srft_terms
from exactrl.algorithms.sft_rl import chord_terms, hpt_terms
from exactrl.config.loader import ConfigError
from exactrl.losses.objective import EntropyTerm, KLTerm, Objective, PolicyTerm
from exactrl.losses.rollout_gap import RolloutGap
from exactrl.registry import Registry
from exactrl.rollout.collect import collect_dynamic_rollout, plain_rollout
from exactrl.rollout.gated import gated, with_demonstrations
from exactrl.rollout.hinted import prefix_rft_rollout, uft_rollout
from exactrl.rollout.mixed import mixed_rollout


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: str  # an estimator of exactrl/advantages
    policy_loss: str  # a loss of exactrl/losses/policy.py (algo.policy_loss overrides it)
    paper: str
    critic: bool = False  # trains a value worker (critic.*) whose values feed the advantages
    whiten_advantages: bool = False  # whitens advantages over the rollout's tokens when algo.whiten_advantages
    rollout: Callable = plain_rollout  # (generator, prompts, indices, rollout, rewards, cfg) -> (samples, stats)
    loss_agg: str | None = None  # the aggregation the method's paper prescribes; others get a warning
    group_baseline: bool = True  # compares responses to the same prompt (schema.py's GROUP_ALGOS: algo.group_size >= 2)
    # its own sub-section of algo (algo.gae, algo.dapo); set under another algorithm it is refused (config/used.py)
    config: str | None = None
    # learns from a demonstration of each prompt besides its own samples (the mixed-policy methods): every
    # training prompt must carry one (data/encode.py), and data.train=builtin is the built-in task's mixed file
    demonstrations: bool = False
    # the method's own objective made from the standard one: (objective, cfg) -> objective (None: the standard)
    reshape: Callable | None = None
    # replaces the estimator's advantages after it ran: (samples, rewards, cfg) -> None (None: keeps them)
    reshape_advantages: Callable | None = None
    # its demonstrations are for SFT (chord, hpt: rollout/gated.py): no reward scored them, they get no advantage
    sft_demonstrations: bool = False
    # ReLIFT: SFT steps of their own on buffered demonstrations of unsolved questions (sft_rl.SFTBuffer)
    sft_buffer: bool = False

    def objective(self, cfg) -> Objective:
        """The policy's loss as data: the clipped surrogate (against the batch's old log-probs;
        the loop switches a rollout that skips that pass to "self", see PolicyTerm), the KL to the
        reference unless it is in the reward (then the estimator must declare how it reads it: a KL
        never lands nowhere), the entropy bonus.
        The entropy metric is free with an entropy term; without one it costs a pass over every
        micro-batch's logits (a softmax over the vocabulary), so it is logged only on request (algo.log_entropy)."""
        a, t = cfg.algo, cfg.train
        agg = {"agg": t.loss_agg, "norm_len": t.loss_agg_norm or cfg.rollout.max_new_tokens}
        terms = [PolicyTerm(loss=a.policy_loss or self.policy_loss, clip_low=a.clip_eps,
                            clip_high=a.clip_eps_high or a.clip_eps, dual_clip=a.dual_clip, **agg)]
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


ALGORITHMS: Registry[Algorithm] = Registry("algo.name")
for algorithm in (
    # GAE: Schulman et al. 2016, arXiv 1506.02438
    Algorithm("ppo", "gae", "ppo", "Schulman et al. 2017, arXiv 1707.06347", critic=True, whiten_advantages=True,
              group_baseline=False, config="gae"),
    Algorithm("grpo", "grpo", "ppo", "Shao et al. 2024, arXiv 2402.03300"),
    Algorithm("dr_grpo", "dr_grpo", "ppo", "Liu et al. 2025, arXiv 2503.20783", loss_agg="seq-mean-token-sum-norm"),
    Algorithm("rloo", "rloo", "ppo", "Ahmadian et al. 2024, arXiv 2402.14740"),
    Algorithm("reinforce_pp", "reinforce_pp", "ppo", "Hu 2025, arXiv 2501.03262", group_baseline=False),
    Algorithm("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo", "Hu 2025, arXiv 2501.03262"),
    Algorithm("gspo", "grpo", "gspo", "Zheng et al. 2025, arXiv 2507.18071"),
    # + clip_eps_high and overlong shaping, set in its config
    Algorithm("dapo", "grpo", "ppo", "Yu et al. 2025, arXiv 2503.14476", rollout=collect_dynamic_rollout,
              config="dapo"),
    # mixed-policy: demonstrations inside the GRPO groups (rollout/mixed.py), the method's own terms
    Algorithm("luffy", "grpo", "ppo", "Yan et al. 2025, arXiv 2504.14945", rollout=mixed_rollout, config="luffy",
              demonstrations=True, reshape=policy_replaced_by(luffy_terms)),
    Algorithm("srft", "grpo", "ppo", "Fu et al. 2025, arXiv 2506.19767", rollout=mixed_rollout, config="srft",
              demonstrations=True, reshape=policy_replaced_by(srft_terms)),
    # mixed-policy: GRPO plus SFT on demonstrations (sft_rl.py)
    Algorithm("chord", "grpo", "ppo", "Zhang et al. 2025, arXiv 2508.11408", rollout=with_demonstrations,
              config="chord", demonstrations=True, reshape=on_terms(chord_terms), sft_demonstrations=True),
    Algorithm("hpt", "grpo", "ppo", "Lv et al. 2025, arXiv 2509.04419", rollout=gated, config="hpt",
              demonstrations=True, reshape=on_terms(hpt_terms), sft_demonstrations=True),
    Algorithm("relift", "grpo", "ppo", "Ma et al. 2025, arXiv 2506.07527", config="relift", demonstrations=True,
              sft_buffer=True),
    # a scheduled hint continued by the policy; GRPO on the continuation, NLL on the hint (its code's estimator: grpo)
    Algorithm("uft", "grpo", "ppo", "Liu et al. 2025, arXiv 2505.16984", rollout=uft_rollout, config="uft",
              demonstrations=True, reshape=uft_objective),
    # a scheduled prefix continued by the policy; Dr.GRPO (its A.2) on every token but a prefix's low-entropy ones
    Algorithm("prefix_rft", "dr_grpo", "ppo", "Huang et al. 2025, arXiv 2507.01679", rollout=prefix_rft_rollout,
              loss_agg="seq-mean-token-sum-norm", config="prefix_rft", demonstrations=True,
              reshape=prefix_rft_objective, reshape_advantages=prefix_rft_advantages),
):
    ALGORITHMS.add(algorithm.name, algorithm)
