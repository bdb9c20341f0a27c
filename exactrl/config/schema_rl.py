"""The RL command's typed configuration (exactrl rl): rollout, algorithm, reward and critic
sections on top of the sections every command shares (schema.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from exactrl.config.schema import CheckPolicy, CommonConfig, OptimConfig, Section


class RolloutConfig(Section):
    engine: Literal["hf"] = Field("hf",
                                  description="Generation engine: 'hf' (the Hugging Face model's own forward in a "
                                              "KV-cached decode loop).")
    temperature: float = Field(1.0, gt=0,
                               description="Sampling temperature; log-probs are computed at the same temperature.")
    top_p: float = Field(1.0, gt=0, le=1,
                         description="Nucleus sampling: draw among the most likely tokens whose probabilities add up "
                                     "to top_p (after temperature and top_k); 1 = off. Like top_k it shapes the "
                                     "draws, not the log-probs: the generator's, the trainer's and the on-policy "
                                     "check's are all log p of the token under the temperature-scaled distribution "
                                     "over the whole vocabulary, before any cut (as TRL, OpenRLHF and verl compute "
                                     "them).")
    top_k: int = Field(0, ge=0,
                       description="Top-k sampling: draw among the k most likely tokens (after temperature, before "
                                   "top_p, as Hugging Face and vLLM apply them); 0 = off. Log-probs as for top_p: "
                                   "before the cut.")
    stop: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        [],
        description="Stop strings (rollout.stop='</answer>' is a list of one): a response ends with the token that "
                    "completes one of them (also when split over tokens); the string stays in the response (its "
                    "tokens, and the text the reward sees, as vLLM's include_stop_str_in_output=true in OpenRLHF), "
                    "and nothing after it is generated, masked in or trained on. Also ends rl's evaluation answers.")
    max_new_tokens: int = Field(48, gt=0, description="Response length limit.")
    batch_size: int = Field(256, gt=0, description="Sequences decoded together.")

    @model_validator(mode="after")
    def _stops_are_text(self):
        if "" in self.stop:
            raise ValueError("rollout.stop: an empty stop string would end every response at once; "
                             "give non-empty strings")
        return self


# The mixed-policy methods (issue 23): each learns from a demonstration of every prompt.
MIXED_ALGOS = ("luffy", "srft", "chord", "hpt", "relift", "uft", "prefix_rft")
RL_ALGOS = ("ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", *MIXED_ALGOS)
# Algorithms whose baseline is the other responses to the same prompt.
GROUP_ALGOS = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp_baseline", "gspo", *MIXED_ALGOS)
# Algorithms whose GRPO groups hold demonstrations beside the policy's samples (exactrl/rollout/mixed.py).
DEMO_GROUP_ALGOS = ("luffy", "srft")
# Mixed-policy methods whose steps hold the demonstrations of their own prompts: one optimizer step per rollout.
ONE_STEP_ALGOS = ("chord", "hpt")


class GAEConfig(Section):
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1 = Monte Carlo returns minus the critic's value).")
    whiten_advantages: bool = Field(True,
                                    description="Whiten the GAE advantages over every response token of the rollout "
                                                "(as OpenRLHF and TRL do).")


class DAPOConfig(Section):
    max_refill_rounds: int = Field(10, ge=0,
                                   description="Extra generation rounds to replace groups with all-equal rewards "
                                               "before giving up.")


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
                                        "entropy (paper: 0.5).")
    positive_coef: float = Field(0.1, ge=0,
                                 description="w_RL = positive_coef x sg(exp(H)) on the NLL of the policy's positive "
                                             "responses (paper: 0.1); negative ones get +log p, weight 1.")
    positive_reward: float = Field(1.0,
                                   description="A response whose reward is at least this is positive (the rollout's "
                                               "accuracy rule: the built-in and math rewards give 1 to a correct "
                                               "answer).")
    demo_clip: bool = Field(True,
                            description="PPO's clip (algo.clip_eps) on the demonstrations' ratio p (behaviour "
                                        "probability 1), as the paper writes it (p <= 1: only the lower bound "
                                        "acts, on negative advantages); false: -p A unclipped, as LUFFY's off-policy "
                                        "term.")
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


# Keys that moved, old -> new: older configs and checkpoints still load (with a notice).
RENAMED = {"algo.lam": "algo.gae.lam", "algo.whiten_advantages": "algo.gae.whiten_advantages",
           "algo.max_refill_rounds": "algo.dapo.max_refill_rounds"}


# Names TRL, peft and OpenRLHF users type, -> exactrl's key (from the command's root) and, where
# the meaning differs, how to translate: the loader suggests them before any spelling match.
ALIASES = {
    "learning_rate": ("optim.lr", ""), "lr_scheduler_type": ("optim.scheduler", ""),
    "adam_beta1": ("optim.betas", " (both: optim.betas=[0.9,0.999])"), "adam_beta2": (
        "optim.betas", " (both: optim.betas=[0.9,0.999])"),
    "adam_epsilon": ("optim.eps", ""),
    "r": ("model.lora.rank", ""), "lora_r": ("model.lora.rank", ""), "lora_rank": ("model.lora.rank", ""),
    "lora_alpha": ("model.lora.alpha", ""), "lora_dropout": ("model.lora.dropout", ""),
    "target_modules": ("model.lora.target_modules", ""), "lora_target_modules": ("model.lora.target_modules", ""),
    "model_name_or_path": ("model.path", ""), "pretrain": ("model.path", ""),
    "bf16": ("model.dtype", " (model.dtype=bf16)"),
    "max_seq_length": ("data.max_length", ""),
    "per_device_train_batch_size": ("train.micro_batch_size", ""), "micro_train_batch_size": (
        "train.micro_batch_size", ""),
    "train_batch_size": ("train.global_batch_size", " (samples per optimizer step, all ranks together)"),
    "gradient_accumulation_steps": ("train.global_batch_size", (" exactrl derives the accumulation steps: set "
                                    "train.global_batch_size = train.micro_batch_size x accumulation steps x ranks")),
    "num_train_epochs": ("train.epochs", ""), "max_epochs": ("train.epochs", ""),
    "max_grad_norm": ("train.max_grad_norm", ""), "logging_steps": ("train.log_every", ""),
    "save_steps": ("train.save_every", ""), "eval_steps": ("train.eval_every", ""),
    "beta": ("algo.kl_coef", " (the KL weight TRL calls beta)"), "init_kl_coef": ("algo.kl_coef", ""),
    "num_generations": ("algo.group_size", ""), "n_samples_per_prompt": ("algo.group_size", ""),
    "num_iterations": ("algo.ppo_epochs", ""), "epsilon": ("algo.clip_eps", ""), "eps_clip": ("algo.clip_eps", ""),
    "epsilon_high": ("algo.clip_eps_high", ""),
    "max_completion_length": ("rollout.max_new_tokens", ""), "generate_max_len": ("rollout.max_new_tokens", ""),
}


class AlgoConfig(Section):
    name: Literal[RL_ALGOS] = Field("grpo", description="RL algorithm: " + ", ".join(RL_ALGOS)
                                    + " (see `exactrl rl --help`).")
    group_size: int = Field(8, ge=1,
                            description="Responses sampled per prompt (>= 2 for the group-baseline algorithms).")
    policy_loss: Literal["ppo", "gspo", "reinforce"] | None = Field(None,
                                                                    description="Override the algorithm's policy "
                                                                                "loss: ppo (clipped token ratio), "
                                                                                "gspo (clipped sequence ratio), "
                                                                                "reinforce (unclipped ratio x "
                                                                                "advantage); unset = the algorithm's "
                                                                                "own.")
    clip_eps: float = Field(0.2, gt=0,
                            description="PPO clip range on the policy ratio (the lower one when clip_eps_high is set).")
    clip_eps_high: float | None = Field(None, gt=0,
                                        description="Upper clip range (DAPO's clip-higher, e.g. 0.28); unset = "
                                                    "clip_eps.")
    dual_clip: float | None = Field(None, gt=1,
                                    description="Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for negative "
                                                "advantages the clipped objective is bounded below by dual_clip x A "
                                                "(3 in the paper, verl's clip_ratio_c, OpenRLHF's dual_clip); unset "
                                                "= off.")
    std_normalize: bool = Field(True,
                                description="Divide group-centred rewards by the group std (grpo, gspo, dapo, luffy, "
                                            "srft); dr_grpo never does.")
    overlong_buffer: int = Field(0, ge=0,
                                 description="DAPO's soft overlong penalty: the last this-many tokens before "
                                             "rollout.max_new_tokens cost up to overlong_penalty (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0,
                                    description="Reward lost by a response that reaches rollout.max_new_tokens (with "
                                                "overlong_buffer > 0).")
    gamma: float = Field(1.0, ge=0, le=1,
                         description="Discount of the return to go (ppo's GAE, reinforce_pp, reinforce_pp_baseline).")
    reward_norm: Literal["none", "whiten", "scale"] = Field("none",
                                                            description="Before advantages: 'whiten' the rollout's "
                                                                        "rewards to mean 0, std 1, or only 'scale' "
                                                                        "them by 1/std (TRL's whiten_rewards without "
                                                                        "shift).")
    kl_coef: float = Field(0.0, ge=0,
                           description="Weight of the KL penalty to the frozen reference (0 = no reference model).")
    kl_target: float | None = Field(None, gt=0,
                                    description="Adaptive KL: move kl_coef after each rollout so the per-response KL "
                                                "approaches this (Ziegler et al. 2019); unset = fixed.")
    kl_horizon: int = Field(10000, gt=0,
                            description="Adaptive KL horizon (responses): how slowly the coefficient moves.")
    kl_in_reward: bool = Field(False,
                               description="Put -kl_coef x KL (k1, per token) in the reward instead of in the loss: "
                                           "reinforce_pp and ppo take it per token (return to go, GAE); grpo, "
                                           "dr_grpo, rloo, gspo and dapo add its sum over the response to the "
                                           "response's score before the group baseline, as verl does.")
    entropy_coef: float = Field(0.0, ge=0,
                                description="Weight of the entropy bonus (subtracted from the loss per token, same "
                                            "aggregation).")
    log_entropy: bool = Field(False,
                              description="Log the policy's mean per-token entropy (entropy) every step. Off by "
                                          "default: without an entropy bonus it costs one extra pass over every "
                                          "micro-batch's logits (a softmax over the vocabulary); with "
                                          "algo.entropy_coef > 0 it is logged anyway, at no cost.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3",
                                                    description="KL estimator per token (Schulman's k1, k2 or k3).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout.")
    mini_batches: int = Field(1, gt=0,
                              description="Optimizer steps per rollout epoch; a rollout holds mini_batches x "
                                          "train.global_batch_size responses.")
    ratio_check: CheckPolicy = Field("error",
                                     description="On-policy check: the ratio must be 1 at the first update after a "
                                                 "rollout.")
    ratio_tol: float = Field(1e-4, gt=0, description="Allowed |ratio - 1| for the on-policy check.")
    gae: GAEConfig = Field(default_factory=GAEConfig,
                           description="ppo's generalised advantage estimation (Schulman et al. 2016).")
    dapo: DAPOConfig = Field(default_factory=DAPOConfig, description="dapo's dynamic sampling (Yu et al. 2025).")
    luffy: LuffyConfig = Field(default_factory=LuffyConfig,
                               description="luffy's demonstrations in the group and policy shaping (Yan et al. 2025).")
    srft: SRFTConfig = Field(default_factory=SRFTConfig,
                             description="srft's demonstration and entropy-weighted terms (Fu et al. 2025).")
    uft: UFTConfig = Field(default_factory=UFTConfig,
                           description="uft's scheduled hint and its NLL (Liu et al. 2025, arXiv 2505.16984).")
    prefix_rft: PrefixRFTConfig = Field(default_factory=PrefixRFTConfig,
                                        description="prefix_rft's scheduled prefix and entropy-based clipping "
                                                    "(Huang et al. 2025, arXiv 2507.01679).")
    chord: ChordConfig = Field(default_factory=ChordConfig, description="chord's SFT weight schedule (arXiv "
                                                                        "2508.11408).")
    hpt: HPTConfig = Field(default_factory=HPTConfig, description="hpt's per-question switch (arXiv 2509.04419).")
    relift: ReLIFTConfig = Field(default_factory=ReLIFTConfig, description="relift's SFT buffer (arXiv 2506.07527).")
    gen_ratio_tol: float = Field(1e-2, gt=0,
                                 description="Allowed |ratio - 1| for the on-policy check when a rollout feeding one "
                                             "update is checked against the generator's log-probs (KV-cached "
                                             "decoding rounds differently from the training forward; the loss uses "
                                             "the forward's own).")


class RewardConfig(Section):
    fn: str | list[str] = Field("exactrl.tasks.arithmetic:reward",
                                description="module:function(prompts, completions, answers) -> list[float] or "
                                            "http://host:port/ (a reward server), or a list of them (summed with "
                                            "reward.weights; the first one counts for accuracy and scores evaluation "
                                            "unless eval.reward_fn is set); exactrl.rewards.mathverify:reward checks "
                                            "math answers. Functions run in a process of their own; rows need an "
                                            "'answer' unless the function has needs_answer = False.")
    weights: list[float] | None = Field(None, description="One weight per reward.fn entry (default: all 1).")
    timeout: float = Field(60.0, gt=0,
                           description="Seconds one batch (a rank's share of a rollout, or an evaluation) may take "
                                       "in a reward function before its process is killed and the batch counts as "
                                       "failed; also the budget for finding which samples a raising reward fails on.")
    retries: int = Field(3, ge=0,
                         description="Retries of a reward server call (connection errors, timeouts, 5xx), with "
                                     "exponential backoff.")
    fallback: float | None = Field(None,
                                   description="Reward for samples the function fails on (raises on them; every "
                                               "sample of a batch that times out, crashes or calls sys.exit); "
                                               "counted in reward_failures. Unset = stop the run naming the sample "
                                               "or batch.")
    url: str | None = Field(None,
                            description="A reward server (http://host:port/, JSON over HTTP, see `python -m "
                                        "exactrl.rewards.server`) used instead of reward.fn; to combine one with "
                                        "functions, list its URL in reward.fn.")

    def specs(self) -> list[str]:
        """The rewards to load, in order: reward.url alone, else reward.fn."""
        if self.url:
            return [self.url]
        return [self.fn] if isinstance(self.fn, str) else list(self.fn)


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-4, scheduler="constant")


class CriticConfig(Section):
    path: str | None = Field(None,
                             description="ppo: the critic's starting model (a causal LM or a saved critic); unset = "
                                         "the policy's starting model. Its value head is new unless the directory "
                                         "holds one.")
    optim: OptimConfig = Field(default_factory=_critic_optim,
                               description="The critic's own optimizer (same keys as optim.*).")
    value_clip: float | None = Field(0.2, gt=0,
                                     description="PPO value clipping: the new value may move this far from the "
                                                 "rollout's before the loss stops rewarding it (unset = off).")
    warmup_rollouts: int = Field(0, ge=0,
                                 description="Rollouts at the start in which only the critic learns (the policy is "
                                             "frozen), so advantages start from a fitted value.")


class RLConfig(CommonConfig):
    """`exactrl rl`: policy-gradient training from rollouts and rewards."""

    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    reward: RewardConfig = RewardConfig()
    critic: CriticConfig = CriticConfig()


    @model_validator(mode="after")
    def _checkpoints_at_rollout_ends(self):
        per_rollout = self.algo.ppo_epochs * self.algo.mini_batches
        if self.train.max_steps % per_rollout:
            whole = -(-self.train.max_steps // per_rollout) * per_rollout
            raise ValueError(f"train.max_steps={self.train.max_steps} must be a multiple of algo.ppo_epochs x "
                             f"algo.mini_batches = {per_rollout}: each rollout feeds that many optimizer steps and a "
                             f"run trains whole rollouts (set train.max_steps={whole}, or 0 to derive it from "
                             "train.epochs)")
        if self.train.save_every % per_rollout:
            raise ValueError(f"train.save_every={self.train.save_every} must be a multiple of algo.ppo_epochs x "
                             f"algo.mini_batches = {per_rollout}: checkpoints are taken between rollouts, so a "
                             "resumed run needs no half-used rollout")
        return self

    @model_validator(mode="after")
    def _deterministic_policy(self):
        if not self.model.disable_dropout:
            raise ValueError("model.disable_dropout=false: an RL policy with dropout computes other log-probs than "
                             "the generator sampled with (the on-policy check would fail); RL trains with dropout off")
        if self.model.lora.rank and self.model.lora.dropout > 0:
            raise ValueError(f"model.lora.dropout={self.model.lora.dropout}: RL needs a deterministic forward (the "
                             "policy's log-probs must equal the generator's); set model.lora.dropout=0")
        return self

    @model_validator(mode="after")
    def _reward_weights_fit(self):
        fns = self.reward.specs()
        if self.reward.url and not self.reward.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url={self.reward.url!r} is not an http:// or https:// address")
        if not fns:
            raise ValueError("reward.fn: give at least one module:function")
        if self.reward.weights is not None and len(self.reward.weights) != len(fns):
            raise ValueError(f"reward.weights has {len(self.reward.weights)} entries for {len(fns)} reward.fn entries")
        return self

    @model_validator(mode="after")
    def _algorithm_needs(self):
        a = self.algo
        if a.name in GROUP_ALGOS and a.group_size < 2:
            raise ValueError(f"algo.name={a.name} compares responses to the same prompt: algo.group_size must be >= 2 "
                             f"(given {a.group_size}); reinforce_pp works with 1")
        if a.name in DEMO_GROUP_ALGOS and getattr(a, a.name).demonstrations >= a.group_size:
            raise ValueError(f"algo.{a.name}.demonstrations={getattr(a, a.name).demonstrations} leaves no response for "
                             f"the policy to sample in a group of algo.group_size={a.group_size}; the group holds "
                             "both: raise algo.group_size or lower the demonstrations")
        if a.name in ONE_STEP_ALGOS and a.ppo_epochs * a.mini_batches != 1:
            raise ValueError(f"algo.name={a.name} trains each rollout's responses and its prompts' demonstrations in "
                             f"one optimizer step: set algo.ppo_epochs=1 and algo.mini_batches=1 (given "
                             f"{a.ppo_epochs} and {a.mini_batches})")
        return self

    @model_validator(mode="after")
    def _groups_fit(self):
        if self.train.global_batch_size % self.algo.group_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} must be a multiple of "
                f"algo.group_size={self.algo.group_size}, so no GRPO group is split across optimizer steps"
            )
        check_rl_layout(self, self.distributed.nproc_per_node)
        return self


def check_rl_layout(cfg: RLConfig, world: int) -> None:
    """A rollout's prompts (whole groups) spread evenly over ``world`` ranks."""
    prompts = cfg.train.global_batch_size * cfg.algo.mini_batches // cfg.algo.group_size
    if cfg.algo.name == "relift" and cfg.algo.relift.buffer_size < world:
        raise ValueError(f"algo.relift.buffer_size={cfg.algo.relift.buffer_size} is smaller than the {world} ranks an "
                         "SFT step spreads its demonstrations over: each rank needs at least one")
    if prompts % world:
        raise ValueError(f"a rollout of {prompts} prompts (train.global_batch_size x algo.mini_batches / "
                         f"algo.group_size) does not spread evenly over {world} ranks; each rank samples whole groups "
                         "for an equal share")

