"""The RL algorithms, one declaration each: what they estimate advantages with, which policy
loss they train, which workers they need and where their rollouts come from. The loop in
rl.py reads these fields and never an algorithm's name; a new algorithm is a new entry here
(plus its estimator or loss in exactrl/advantages or exactrl/losses when it brings one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    config: str | None = None  # its own sub-section of algo (algo.gae, algo.dapo); set under another algorithm it is refused (config/used.py)


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
    Algorithm("dapo", "grpo", "ppo", "Yu et al. 2025, arXiv 2503.14476", rollout=collect_dynamic_rollout, config="dapo"),
):
    ALGORITHMS.add(algorithm.name, algorithm)

