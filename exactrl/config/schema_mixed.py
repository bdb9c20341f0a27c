"""The mixed-policy methods' own sections of algo (algo.<config> of their rows in
config/methods.py): each default names its source, the paper or its official code, and where the
two differ the other's choice is an option."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exactrl.config.schema import Section


class LuffyConfig(Section):
    demonstrations: int = Field(1, ge=1,
                                description="Demonstrations in each GRPO group of algo.group_size: the policy "
                                            "samples algo.group_size minus this many (the prompt's one "
                                            "demonstration repeated). 1 as the paper (7 + 1) and its code "
                                            "(rollout.n=8, n_prefix=1).")
    gamma: float = Field(0.1, gt=0,
                         description="Policy shaping f(p) = p / (p + gamma) on demonstration tokens (paper and code: "
                                     "0.1).")
    clip: bool = Field(True,
                       description="PPO's clip on the policy's own tokens, as the paper's objective has it; "
                                   "its official code trains without (loss_remove_clip=True): false. With "
                                   "algo.policy_loss set, that loss is used instead.")


class SRFTConfig(Section):
    demonstrations: int = Field(1, ge=1,
                                description="Demonstrations in each GRPO group of algo.group_size (their advantages "
                                            "come from the whole group, as in LUFFY, on which SRFT builds); the "
                                            "policy samples the rest. 1, as LUFFY.")
    sft_coef: float = Field(0.5, ge=0,
                            description="w_SFT = sft_coef x sg(exp(-H)) on the demonstrations' NLL, H the token's "
                                        "entropy (paper and code: 0.5, the code's sft_loss_coef=-0.5 subtracted).")
    sft_weight: Literal["exp_neg_entropy", "exp_entropy"] = Field(
        "exp_neg_entropy",
        description="The entropy factor of w_SFT: 'exp_neg_entropy', sg(exp(-H)) as the paper's Eq. 8 (imitate less "
                    "where the policy is unsure); 'exp_entropy', sg(exp(+H)) as its official code computes it "
                    "(mix_core_alg.py: entropy.exp().detach()).")
    positive_coef: float = Field(0.1, ge=0,
                                 description="w_RL = positive_coef x sg(exp(H)) on the NLL of the policy's positive "
                                             "responses (paper: 0.1); negative ones get +log p, weight 1.")
    positive_reward: float = Field(1.0,
                                   description="A response whose reward is at least this is positive (the rollout's "
                                               "accuracy rule: the built-in and math rewards give 1 to a correct "
                                               "answer).")
    demo_gamma: float | None = Field(None, gt=0,
                                     description="Shaping of the demonstrations' ratio: None, the ratio p as the "
                                                 "paper writes it; a number, LUFFY's f(p) = p / (p + demo_gamma), "
                                                 "as the official code's off_policy_reshape=p_div_p_0.1 (0.1).")
    demo_clip: bool = Field(True,
                            description="PPO's clip (algo.clip_eps) on the demonstrations' ratio p (behaviour "
                                        "probability 1), as the paper writes it (p <= 1: only the lower bound "
                                        "acts, on negative advantages); false: -f(p) A unclipped, as LUFFY's "
                                        "off-policy term and SRFT's official code, which computes it with LUFFY's.")


class UFTConfig(Section):
    """UFT (Liu et al. 2025, arXiv 2505.16984); defaults from its official code (liumy2010/UFT run.py)."""

    hint_steps: int = Field(300, ge=1,
                            description="Optimizer steps over which the hint's expected share of the demonstration "
                                        "falls from hint_high to hint_low (cosine); later rollouts get no hint (the "
                                        "code's T_hint: 300 of its 500 steps).")
    hint_high: float = Field(0.95, ge=0, le=1, description="Expected hint share at step 0 (the code's upper_prob).")
    hint_low: float = Field(0.05, ge=0, le=1,
                            description="Expected hint share at step hint_steps (the code's lower_prob).")
    hint_parts: int = Field(5, ge=1,
                            description="The demonstration is cut into this many equal parts; a prompt's hint is the "
                                        "first k of them, k ~ Binomial(hint_parts, share) (the code's 5 reasoning "
                                        "steps).")
    nll_coef: float = Field(0.001, ge=0,
                            description="Weight of the NLL on the hint tokens beside GRPO on the policy's "
                                        "continuation (the code's sft_loss_coef).")
    nll_agg: Literal["token-mean", "seq-mean-token-sum"] = Field(
        "token-mean",
        description="The hint NLL's normaliser: 'token-mean' over the step's hint tokens (the code's mean over hint "
                    "tokens, there per micro-batch) or 'seq-mean-token-sum', the paper's sum over a hint's tokens, "
                    "averaged over the step's hinted sequences.")


class PrefixRFTConfig(Section):
    """Prefix-RFT (Huang et al. 2025, arXiv 2507.01679); defaults from its appendix A.2."""

    prefixed: int = Field(1, ge=1,
                          description="Responses per group that continue a prefix of the demonstration (the paper: "
                                      "one of 8); the others are sampled from the prompt alone.")
    decay_steps: int = Field(500, ge=1,
                             description="Optimizer steps over which the prefix share's lower bound decays (cosine) "
                                         "from low_start to low_end (the paper's 500 training steps).")
    low_start: float = Field(0.95, ge=0, le=1, description="Lower bound of the prefix share at step 0.")
    low_end: float = Field(0.05, ge=0, le=1, description="Lower bound of the prefix share from step decay_steps on.")
    high: float = Field(0.95, ge=0, le=1,
                        description="Upper bound of the prefix share: a prefix is int(l x the demonstration's length) "
                                    "tokens, l ~ U[lower bound, high].")
    keep: float = Field(0.2, gt=0, le=1,
                        description="Share of each prefix's tokens, those of highest entropy, that train "
                                    "(entropy-based clipping: the others' advantage is zeroed; the paper's top 20%).")
    clip_prefix: bool = Field(True,
                              description="Clip the prefix tokens' ratio like the policy's (the code's enable_clip); "
                                          "false: unclipped ratio x advantage on them.")
    advantage: Literal["group", "code"] = Field(
        "group",
        description="'group': Dr.GRPO's group-centred rewards, prefixed responses in the group (the paper's A.2); "
                    "'code': the official code's, the unprefixed responses centred on their own mean, a prefixed "
                    "response's continuation on 0 and its prefix tokens on that mean.")
class ChordConfig(Section):
    """CHORD (Zhang et al. 2025, arXiv 2508.11408): (1 - mu) x GRPO + mu x SFT in one step. Defaults: CHORD-mu as
    Trinity-RFT's examples/mix_chord/mix_chord.yaml comments give it (warm-up 0, decay 200, peak 0.9, valley
    0.05, phi off); CHORD-phi there is mu_peak=mu_valley=0.1, mu_decay=0, phi=true."""

    mu_warmup: int = Field(0, ge=0, description="Optimizer steps over which mu rises linearly from 0 to mu_peak "
                                                "(Trinity-RFT's mu_warmup_steps).")
    mu_decay: int = Field(200, ge=0, description="Optimizer steps after the warm-up over which mu falls along a half "
                                                 "cosine from mu_peak to mu_valley, then held (mu_decay_steps).")
    mu_peak: float = Field(0.9, ge=0, le=1, description="mu at the end of the warm-up: the SFT share of the loss.")
    mu_valley: float = Field(0.05, ge=0, le=1, description="mu after the decay.")
    phi: bool = Field(False, description="CHORD-phi: weight each demonstration token's NLL by sg(p (1 - p)), p the "
                                         "policy's probability of the token (Trinity-RFT's enable_phi_function).")


class HPTConfig(Section):
    """HPT (Lv et al. 2025, arXiv 2509.04419): per question, SFT on its demonstration when few of its responses are
    correct, GRPO on its responses otherwise. Defaults: TsinghuaC3I/Unify-Post-Training exp_scripts/train.sh."""

    gate: int = Field(0, ge=0, description="A question whose group has at most this many correct responses (first "
                                           "reward >= 1) is learnt by SFT on its demonstration instead of GRPO "
                                           "(SWITCH_GATE: 0 for Qwen2.5-Math-7B, 2 in train_llama.sh).")
    sft_coef: float = Field(1.0, gt=0, description="Weight of the SFT term (SFT_LOSS_COEF; 0.3 there for "
                                                   "Qwen2.5-Math-1.5B).")


class ReLIFTConfig(Section):
    """ReLIFT (Ma et al. 2025, arXiv 2506.07527): GRPO, plus an SFT step on buffered demonstrations of the questions
    no response solved. Defaults: TheRoadQaQ/ReLIFT examples/math-7b/train.sh."""

    buffer_size: int = Field(128, gt=0, description="Demonstrations an SFT step trains on: once the buffer holds "
                                                    "this many, the newest this-many make one optimizer step "
                                                    "(sft_data_size = sft_mini_batch_size, one SFT epoch).")
    mean_of_means: bool = Field(False, description="Normalise the SFT step as ReLIFT's code does: the mean over "
                                                   "micro-batches (all ranks) of each micro-batch's token mean, "
                                                   "which over-weights micro-batches with few tokens (the bug of "
                                                   "arXiv 2604.23747). Off: the step's one token mean.")
