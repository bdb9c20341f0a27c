"""Every RL method declared once, as data: what it estimates and trains, what it needs and which
settings it uses. The config (algo.name's choices, the refusals of config/used.py), the CLI's help,
the pipelines' plans and the algorithm registry (exactrl/algorithms/registry.py, which attaches each
method's code: its rollout source and its objective's terms) all read these rows; nothing else
lists method names (tests/test_methods.py refuses a hand-written list anywhere else).

A new method is one row here, its maths (an estimator or loss, its rollout source, its terms), its
entry in algorithms/registry.py, its config section (schema_rl.py / schema_mixed.py) if it has one,
an example and a docs row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What the advantage estimators (exactrl/advantages/estimators.py) read of algo.*: grpo's divides by
# the group std when algo.std_normalize; these discount the return to go by algo.gamma (and take the KL
# in the reward per token). tests/test_methods.py runs every estimator to check both.
STD_ESTIMATORS = ("grpo",)
DISCOUNT_ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline")


@dataclass(frozen=True)
class Method:
    name: str  # algo.name
    paper: str
    summary: str  # one line for `exactrl rl --help`
    advantage: str  # an estimator of exactrl/advantages/estimators.py
    policy_loss: str = "ppo"  # a loss of exactrl/losses/policy.py (algo.policy_loss overrides it)
    loss_agg: str | None = None  # the aggregation the paper prescribes; others get a warning
    critic: bool = False  # trains a value worker (critic.*) whose values feed the advantages
    whiten_advantages: bool = False  # whitens advantages over the rollout's tokens when algo.gae.whiten_advantages
    group_baseline: bool = True  # compares responses to the same prompt: algo.group_size >= 2
    # its own sub-section of algo (algo.gae, algo.dapo); set under another algo.name it is refused with
    # ``section_refusal`` (config/used.py)
    config: str | None = None
    section_refusal: str = ""
    # learns from a demonstration of each prompt besides its own samples (the mixed-policy methods): every
    # training prompt must carry one (data/encode.py), and data.train=builtin is the built-in task's mixed file
    demonstrations: bool = False
    # its groups hold algo.<config>.demonstrations demonstrations beside the policy's samples (rollout/mixed.py)
    demonstrations_in_group: bool = False
    # its demonstrations are for SFT (rollout/gated.py): no reward scored them, they get no advantage
    sft_demonstrations: bool = False
    sft_buffer: bool = False  # SFT steps of their own on buffered demonstrations (algo.<config>.buffer_size)
    # its rollouts continue a hint: the generator never scores the hint, so samples carry no generator log-probs
    hinted: bool = False
    # its steps hold the demonstrations of their own prompts: one optimizer step per rollout
    one_step: bool = False
    # its loss on the policy's samples takes a ratio to the policy that sampled them (False: log-likelihoods,
    # so algo.policy_loss, the on-policy check and the rollout correction have nothing to act on)
    policy_ratio: bool = True
    # what algo.clip_eps bounds: the policy's samples' ratio, or only the demonstrations' ratio p (<= 1, so
    # no upper bound and no dual clip act)
    clips: Literal["policy", "demonstrations"] = "policy"
    clip_switch: str | None = None  # the key of its section that turns its clip off (false: nothing is clipped)
    # trains the policy-gradient term on its estimator's advantages (False: a distillation term to a teacher is its
    # whole objective, distill.*; nothing reads advantages, so the reward-shaping and clip settings are refused)
    policy_term: bool = True

    @property
    def family(self) -> str:
        """The docs' page: the policy-gradient methods, or the mixed-policy ones that also learn from demonstrations."""
        if not self.policy_term:
            return "distillation"
        return "mixed-policy" if self.demonstrations else "policy-gradient"

    @property
    def std_normalize(self) -> bool:
        """Whether algo.std_normalize acts: its estimator divides group-centred rewards by the group std."""
        return self.advantage in STD_ESTIMATORS

    @property
    def discount(self) -> bool:
        """Whether algo.gamma acts: its estimator discounts the return to go."""
        return self.advantage in DISCOUNT_ESTIMATORS

    @property
    def short_paper(self) -> str:
        """'Schulman 2017' from 'Schulman et al. 2017, arXiv 1707.06347'."""
        authors, year = self.paper.split(",")[0].rsplit(" ", 1)
        return f"{authors.removesuffix(' et al.')} {year}"


# In the order users read them (algo.name's choices, `exactrl rl --help`).
METHODS: dict[str, Method] = {m.name: m for m in (
    # GAE: Schulman et al. 2016, arXiv 1506.02438
    Method("ppo", "Schulman et al. 2017, arXiv 1707.06347", "critic + GAE, clipped policy and value losses", "gae",
           critic=True, whiten_advantages=True, group_baseline=False, config="gae",
           section_refusal="only ppo estimates advantages with GAE"),
    Method("grpo", "Shao et al. 2024, arXiv 2402.03300", "group-normalised advantages, PPO clip", "grpo"),
    Method("dr_grpo", "Liu et al. 2025, arXiv 2503.20783", "group-centred only, constant-length loss", "dr_grpo",
           loss_agg="seq-mean-token-sum-norm"),
    # + clip_eps_high and overlong shaping, set in its config
    Method("dapo", "Yu et al. 2025, arXiv 2503.14476", "clip-higher, dynamic sampling, overlong penalty", "grpo",
           config="dapo", section_refusal="dynamic sampling is dapo's"),
    Method("rloo", "Ahmadian et al. 2024, arXiv 2402.14740", "leave-one-out baseline", "rloo"),
    Method("reinforce_pp", "Hu 2025, arXiv 2501.03262", "REINFORCE++: return to go, global whitening",
           "reinforce_pp", group_baseline=False),
    Method("reinforce_pp_baseline", "Hu 2025, arXiv 2501.03262", "REINFORCE++ after subtracting the group mean",
           "reinforce_pp_baseline"),
    Method("gspo", "Zheng et al. 2025, arXiv 2507.18071", "sequence-level ratio and clipping", "grpo",
           policy_loss="gspo"),
    # mixed-policy: demonstrations inside the GRPO groups, the method's own terms
    Method("luffy", "Yan et al. 2025, arXiv 2504.14945", "demonstrations in the group, p/(p+0.1) on their tokens",
           "grpo", config="luffy", section_refusal="these are luffy's settings", demonstrations=True,
           demonstrations_in_group=True, clip_switch="clip"),
    Method("srft", "Fu et al. 2025, arXiv 2506.19767",
           "entropy-weighted SFT and RL on demonstrations and samples", "grpo", config="srft",
           section_refusal="these are srft's settings", demonstrations=True, demonstrations_in_group=True,
           policy_ratio=False, clips="demonstrations", clip_switch="demo_clip"),
    # mixed-policy: GRPO plus SFT on demonstrations
    Method("chord", "Zhang et al. 2025, arXiv 2508.11408", "GRPO plus SFT on demonstrations, weight scheduled",
           "grpo", config="chord", section_refusal="algo.chord.* is chord's", demonstrations=True,
           sft_demonstrations=True, one_step=True),
    Method("hpt", "Lv et al. 2025, arXiv 2509.04419", "per question, SFT on its demonstration or GRPO", "grpo",
           config="hpt", section_refusal="algo.hpt.* is hpt's", demonstrations=True, sft_demonstrations=True,
           one_step=True),
    Method("relift", "Ma et al. 2025, arXiv 2506.07527", "GRPO, SFT steps on demonstrations of unsolved questions",
           "grpo", config="relift", section_refusal="algo.relift.* is relift's", demonstrations=True,
           sft_buffer=True),
    # a scheduled hint continued by the policy; GRPO on the continuation, NLL on the hint (its code's estimator: grpo)
    Method("uft", "Liu et al. 2025, arXiv 2505.16984", "a scheduled hint continued; GRPO on it, NLL on the hint",
           "grpo", config="uft", section_refusal="the scheduled hint is uft's", demonstrations=True, hinted=True),
    # a scheduled prefix continued by the policy; Dr.GRPO (its A.2) on every token but a prefix's low-entropy ones
    Method("prefix_rft", "Huang et al. 2025, arXiv 2507.01679", "a scheduled prefix continued, Dr.GRPO", "dr_grpo",
           loss_agg="seq-mean-token-sum-norm", config="prefix_rft",
           section_refusal="the scheduled prefix is prefix_rft's", demonstrations=True, hinted=True),
    # the student samples, a frozen teacher (distill.teacher) scores each sampled token; the loss is a per-token
    # divergence to it (distill.loss, default k1 as a negative advantage through the importance ratio); GKD
    # (Agarwal et al. 2024, arXiv 2306.13649) with lambda = 1 is distill.loss=jsd or reverse_kl
    Method("on_policy_distill", "Lu et al. 2025, Thinking Machines Lab, On-Policy Distillation",
           "the student samples, a per-token divergence to a teacher on its tokens", "none", group_baseline=False,
           policy_ratio=False, policy_term=False),
)}

NAMES = tuple(METHODS)


def names(**facts) -> tuple[str, ...]:
    """The methods whose rows have these facts, in METHODS' order: ``names(critic=True)``."""
    return tuple(m.name for m in METHODS.values() if all(getattr(m, k) == v for k, v in facts.items()))


def method(name: str) -> Method:
    """The row of algo.name (which the config has already checked)."""
    return METHODS[name]
