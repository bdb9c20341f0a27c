"""The RL algorithms, one declaration each: what they estimate advantages with, which loss
they train (``objective``: the terms of exactrl/losses/objective.py it is made of), which workers
they need and where their rollouts come from. The loop in rl.py reads these fields and never an
algorithm's name; a new algorithm is a new entry here (plus its estimator or loss in
exactrl/advantages or exactrl/losses when it brings one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exactrl.advantages.estimators import TOKEN_REWARDS
from exactrl.config.loader import ConfigError
from exactrl.losses.objective import EntropyTerm, KLTerm, Objective, PolicyTerm
from exactrl.registry import Registry
from exactrl.rollout.collect import collect_dynamic_rollout, plain_rollout


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

    def objective(self, cfg) -> Objective:
        """The policy's loss as data: the clipped surrogate (against the batch's old log-probs;
        the loop switches a rollout that skips that pass to "self", see PolicyTerm), the KL to the
        reference unless it is in the reward (then the estimator must declare how it reads it: a KL
        never lands nowhere), the entropy bonus.
        The entropy metric is free with an entropy term; without one it costs a pass over every
        micro-batch's logits (a softmax over the vocabulary), so it is logged only on request (algo.log_entropy)."""
        a, t = cfg.algo, cfg.train
        agg = {"agg": t.loss_agg, "norm_len": t.loss_agg_norm or cfg.rollout.max_new_tokens}
        terms = [PolicyTerm(loss=a.policy_loss or self.policy_loss, clip_low=a.clip_eps, clip_high=a.clip_eps_high
                            or a.clip_eps,
                            dual_clip=a.dual_clip, **agg)]
        if a.kl_coef > 0 and a.kl_in_reward and self.advantage not in TOKEN_REWARDS:
            raise ConfigError(f"algo.kl_in_reward=true: algo.name={self.name}'s estimator '{self.advantage}' does not "
                              "read per-token rewards, so the KL would land nowhere; set algo.kl_in_reward=false")
        if a.kl_coef > 0 and not a.kl_in_reward:
            terms.append(KLTerm(coef=a.kl_coef, estimator=a.kl_estimator, **agg))
        if a.entropy_coef > 0:
            terms.append(EntropyTerm(coef=a.entropy_coef, **agg))
        return Objective(tuple(terms), metrics=("entropy",) if a.log_entropy and a.entropy_coef == 0 else ())


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
):
    ALGORITHMS.add(algorithm.name, algorithm)

