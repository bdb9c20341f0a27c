"""The RL command's typed configuration (exactrl rl): rollout, algorithm, reward and critic
sections on top of the sections every command shares (schema.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from exactrl.config.methods import METHODS, NAMES, names
from exactrl.config.schema import CheckPolicy, CommonConfig, OptimConfig, Section, check_layout
from exactrl.config.schema_distill import DistillConfig, check_teacher_engine
from exactrl.config.schema_env import EnvConfig, check_env
from exactrl.config.schema_mixed import (
    ChordConfig,
    HPTConfig,
    LuffyConfig,
    PrefixRFTConfig,
    ReLIFTConfig,
    SRFTConfig,
    UFTConfig,
)
from exactrl.config.schema_ray import RayConfig, check_ray
from exactrl.config.schema_task import TaskConfig
from exactrl.config.schema_vllm import VLLMConfig


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf",
                                          description="Generation engine: 'hf' (the Hugging Face model's own forward "
                                                      "in a KV-cached decode loop, in the trainer's process) or "
                                                      "'vllm' (a vLLM engine in a process of its own, one per rank, "
                                                      "synced and verified after every update: rollout.vllm.*).")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="The vLLM engine (rollout.engine=vllm).")
    temperature: float = Field(1.0, gt=0,
                               description="Sampling temperature; log-probs are computed at the same temperature.")
    top_p: float = Field(1.0, gt=0, le=1,
                         description="Nucleus sampling: draw among the most likely tokens whose probabilities add up "
                                     "to top_p (after temperature and top_k); 1 = off. Like top_k it shapes the "
                                     "draws, not the log-probs: the generator's, the trainer's and the on-policy "
                                     "check's are all log p of the token under the temperature-scaled distribution "
                                     "over the whole vocabulary, before any cut (as TRL, OpenRLHF and verl compute "
                                     "them). A generator reporting them over the kept set (vLLM's "
                                     "processed_logprobs) is compared with the trainer's over the same set, "
                                     "replayed on its logits.")
    top_k: int = Field(0, ge=0,
                       description="Top-k sampling: draw among the k most likely tokens (after temperature, before "
                                   "top_p, as Hugging Face and vLLM apply them); 0 = off. Log-probs as for top_p: "
                                   "in the generator's convention (logprobs_over), compared over the same set.")
    stop: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        [],
        description="Stop strings (rollout.stop='</answer>' is a list of one): a response ends with the token that "
                    "completes one of them (also when split over tokens); the string stays in the response (its "
                    "tokens, and the text the reward sees, as vLLM's include_stop_str_in_output=true in OpenRLHF), "
                    "and nothing after it is generated, masked in or trained on. Also ends rl's evaluation answers.")
    max_new_tokens: int = Field(48, gt=0, description="Response length limit.")
    batch_size: int = Field(256, gt=0, description="Sequences decoded together.")
    decode: Literal["auto", "eager", "graphs"] = Field(
        "auto",
        description="How rollout.engine=hf decodes: 'eager' (the decode loop, finished rows leaving the batch), "
                    "'graphs' (a static-shape step -- fixed batch, cache written in place, finished rows fed "
                    "padding -- replayed from a CUDA graph on CUDA, run as is elsewhere: the same tokens for the "
                    "same seeds; for small models, whose decode on a GPU is bound by kernel launches), 'auto' (graphs "
                    "on CUDA where the generation self-check runs, eager otherwise). The self-check checks the "
                    "path chosen and steps down to the eager loop, with a notice, for a model the static step "
                    "cannot run (caches other than plain key/value layers, sharded parameters, a step that "
                    "waits for the device) or gets wrong.")
    sync_check: Literal["error", "warn"] = Field("error",
                                                 description="After every push of the policy's weights to the "
                                                             "generator: the digest the generator computes from the "
                                                             "weights it holds must equal the trainer's digest of what "
                                                             "it sent (name, dtype, shape, bytes of every tensor), and "
                                                             "its log-probs of a fixed probe sequence the trainer's "
                                                             "within rollout.probe_tol. error stops the run naming "
                                                             "the generator, the version and the first differing "
                                                             "tensor; warn only warns.")
    probe_tol: float | None = Field(None, gt=0,
                                    description="Allowed largest absolute log-prob difference on the sync probe; "
                                                "unset = by model.dtype: fp32 1e-3, bf16 0.1.")

    @model_validator(mode="after")
    def _stops_are_text(self):
        if "" in self.stop:
            raise ValueError("rollout.stop: an empty stop string would end every response at once; "
                             "give non-empty strings")
        return self


class GAEConfig(Section):
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1 = Monte Carlo returns minus the critic's value).")
    whiten_advantages: bool = Field(True,
                                    description="Whiten the GAE advantages over every response token of the rollout "
                                                "(as OpenRLHF and TRL do).")


class DAPOConfig(Section):
    max_refill_rounds: int = Field(10, ge=0,
                                   description="Extra generation rounds to replace groups with all-equal rewards "
                                               "before giving up.")


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
    name: Literal[NAMES] = Field("grpo", description="RL algorithm: " + ", ".join(NAMES)
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
                                description="Divide group-centred rewards by the group std ("
                                            + ", ".join(names(std_normalize=True)) + "); dr_grpo never does.")
    overlong_buffer: int = Field(0, ge=0,
                                 description="DAPO's soft overlong penalty: the last this-many tokens before "
                                             "rollout.max_new_tokens cost up to overlong_penalty (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0,
                                    description="Reward lost by a response that reaches rollout.max_new_tokens (with "
                                                "overlong_buffer > 0).")
    gamma: float = Field(1.0, ge=0, le=1,
                         description="Discount of the return to go (" + ", ".join(names(discount=True)) + ").")
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
                                           + ", ".join(names(discount=True)) + " take it per token (return to go, "
                                           "GAE); the others add its sum over the response to the response's score "
                                           "before the group baseline, as verl does.")
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
    rollout_correction: Literal["none", "tis", "icepop", "seq_mask"] = Field(
        "none", description="Correct the rollout-trainer gap (the generator's log-probs against the trainer's, "
                            "rho = pi_trainer / pi_gen per sampled token): 'tis' weighs each token's loss by "
                            "min(rho, C) (Yao et al. 2025, truncated IS); 'icepop' by rho, 0 outside [1/C_low, C] "
                            "(IcePop, arXiv 2510.18855; masked IS, Liu et al. 2025); 'seq_mask' by rho, 0 in "
                            "responses whose geometric-mean rho leaves [1/C_low, C] (OpenRLHF's seq-mask-tis). "
                            "A masked token stays in the normaliser. 'none': measured (rollout_gap/*), not corrected.")
    rollout_correction_form: Literal["decoupled", "folded"] = Field(
        "decoupled", description="'decoupled': the PPO ratio against the trainer's old log-probs, times the "
                                 "correction's weight (rho from the old log-probs); 'folded': the PPO ratio against "
                                 "the generator's log-probs (verl's bypass mode), times weight / rho (rho from the "
                                 "current forward), so PPO's clip is centred on the generator.")
    rollout_correction_cap: float | None = Field(
        None, gt=1, description="C: tis truncates at it, icepop and seq_mask mask above it. Unset = the method's "
                                "source: tis 2 (Yao et al. 2025; TRL's token_truncate cap 2.0, PR #3867; verl's "
                                "rollout_is_threshold 2.0), icepop 5 (IcePop's beta; OpenRLHF's "
                                "is_correction_threshold [0.5, 5.0]), seq_mask 3 (TRL's sequence_mask cap, whose "
                                "bound is on the product of the ratios, from above only).")
    rollout_correction_cap_low: float | None = Field(
        None, gt=1, description="C_low of icepop and seq_mask: they mask below 1/C_low. Unset = icepop 2 (IcePop's "
                                "alpha = 0.5, OpenRLHF's 0.5), seq_mask its cap ([1/C, C]).")
    rollout_gap_cap: float = Field(
        2.0, gt=1, description="C of the logged share of sampled tokens whose rho leaves [1/C, C] "
                               "(rollout_gap/outside_frac; 2 = TIS's cap).")


class RewardConfig(Section):
    fn: str | list[str] = Field("exactrl.tasks.arithmetic:reward",
                                description="module:function(prompts, completions, answers) -> list[float] or "
                                            "http://host:port/ (a reward server), or a list of them (summed with "
                                            "reward.weights; the first one counts for accuracy and scores evaluation "
                                            "unless eval.reward_fn is set); exactrl.rewards.mathverify:reward checks "
                                            "math answers. Functions run in a process of their own; rows need an "
                                            "'answer' unless the function has needs_answer = False.")
    weights: list[float] | None = Field(None, description="One weight per reward.fn entry (default: all 1); [0] with "
                                                             "reward.model trains on the reward model alone.")
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
    model: str | None = Field(None,
                              description="A trained reward model (the final/ directory of an `exactrl rm` run) "
                                          "scoring every response on the token ids the policy sampled (prompt and "
                                          "response, nothing decoded and re-encoded: it must share the policy's "
                                          "tokenizer) at the response's last token (a process reward model, "
                                          "rm.kind=process: at each step's separator, reduced by "
                                          "reward.model_reduce), by a frozen worker after the rollout is gathered. "
                                          "The reward is sum(reward.weights x reward.fn) + "
                                          "reward.model_weight x its normalised score, logged as reward/model; "
                                          "reward.fn is still computed and its first entry still counts for "
                                          "accuracy and evaluation, so to train on the reward model alone set "
                                          "reward.weights=[0] (the checker stays, monitored at weight 0).")
    model_weight: float = Field(1.0, description="reward.model's weight in the reward.")
    model_normalize: bool = Field(True,
                                  description="Normalise reward.model's score as (score - mean) / std with the "
                                              "statistics its training saved (reward_stats.json in its directory; "
                                              "the run stops naming the file when it is missing). A process reward "
                                              "model's reward is a probability in [0, 1] (reward.model_reduce) and "
                                              "its saved statistics are of step logits, not of that: it is refused "
                                              "with true, so set false for one (the probability as it is).")
    model_reduce: Literal["min", "prod", "last"] = Field(
        "min", description="A process reward model's (rm.kind=process) one reward per response from its steps' "
                           "scores s. The sampled response is cut into steps at every occurrence of the separator its "
                           "training saved (none: one step); a step's s is the head at its separator's last token, "
                           "the final step's at a separator placed after it (its EOS left out), as the model was "
                           "trained to read. min = min over steps of sigmoid(s) (Lightman et al. 2023), prod = their "
                           "product, last = the final step's.")

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
    ray: RayConfig = RayConfig()
    distill: DistillConfig = Field(default_factory=DistillConfig,
                                   description="On-policy distillation: a teacher scoring the student's samples.")
    task: TaskConfig = Field(default_factory=TaskConfig,
                             description="The built-in task model.path=builtin / builtin-sft and data.*=builtin mean "
                                         "(task.name=calculator: the multi-turn tool task).")
    env: EnvConfig = Field(default_factory=EnvConfig,
                           description="Multi-turn and agent rollouts: an environment answering each policy turn.")


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
        a, m = self.algo, METHODS[self.algo.name]
        if m.group_baseline and a.group_size < 2:
            raise ValueError(f"algo.name={a.name} compares responses to the same prompt: algo.group_size must be >= 2 "
                             f"(given {a.group_size}); reinforce_pp works with 1")
        if m.demonstrations_in_group and (demos := getattr(a, m.config).demonstrations) >= a.group_size:
            raise ValueError(f"algo.{m.config}.demonstrations={demos} leaves no response for "
                             f"the policy to sample in a group of algo.group_size={a.group_size}; the group holds "
                             "both: raise algo.group_size or lower the demonstrations")
        if not m.policy_term and self.distill.teacher is None:
            raise ValueError(f"algo.name={a.name} trains a distillation term alone: set distill.teacher (a model "
                             "sharing the student's tokenizer, e.g. distill.teacher=builtin-sft)")
        check_teacher_engine(self)
        check_env(self)
        if m.one_step and a.ppo_epochs * a.mini_batches != 1:
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
        check_ray(self)
        if self.ray.enabled:  # Ray starts the trainer ranks; batch sizes must divide by their number
            check_layout(self, self.ray.ranks)
        check_rl_layout(self, self.ray.ranks if self.ray.enabled else self.distributed.nproc_per_node)
        return self


def check_rl_layout(cfg: RLConfig, world: int) -> None:
    """A rollout's prompts (whole groups) spread evenly over ``world`` ranks."""
    prompts = cfg.train.global_batch_size * cfg.algo.mini_batches // cfg.algo.group_size
    m = METHODS[cfg.algo.name]
    if m.sft_buffer and (size := getattr(cfg.algo, m.config).buffer_size) < world:
        raise ValueError(f"algo.{m.config}.buffer_size={size} is smaller than the {world} ranks an "
                         "SFT step spreads its demonstrations over: each rank needs at least one")
    if prompts % world:
        raise ValueError(f"a rollout of {prompts} prompts (train.global_batch_size x algo.mini_batches / "
                         f"algo.group_size) does not spread evenly over {world} ranks; each rank samples whole groups "
                         "for an equal share")

