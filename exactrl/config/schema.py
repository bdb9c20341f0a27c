"""Typed configuration, one tree per command. Every field is documented where it is declared.

``model.path`` / ``data.*`` accept ``builtin`` to mean the built-in task, model and data
(built locally on first use, see exactrl/tasks/builtin.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

# YAML 1.1 reads a bare `off` as false; accept it as the word the user meant.
CheckPolicy = Annotated[Literal["error", "warn", "off"], BeforeValidator(lambda v: "off" if v is False else v)]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class Section(BaseModel):
    # allow_inf_nan=False: optim.lr=inf or a NaN anywhere a float is taken is refused by name.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LoraConfig(Section):
    rank: int = Field(0, ge=0,
                      description="LoRA rank r (peft): train low-rank adapters B A (r x in, out x r) on the target "
                                  "layers and freeze the base weights; 0 = off (full fine-tuning).")
    alpha: float = Field(16.0, gt=0,
                         description="LoRA scaling numerator: a target layer computes W x + (alpha / rank) B A x.")
    dropout: float = Field(0.0, ge=0, lt=1,
                           description="Dropout on the adapters' input (sft only: RL needs a deterministic forward, "
                                       "as model.disable_dropout).")
    target_modules: str | list[str] = Field("all-linear",
                                            description="Layers that get adapters: 'all-linear' (every linear layer "
                                                        "but the output head, as QLoRA found all are needed to match "
                                                        "full fine-tuning) or module-name suffixes, e.g. "
                                                        "[q_proj,v_proj] (one name alone, q_proj, is a list of one); "
                                                        "the output head (lm_head) cannot be one.")
    merge_on_save: bool = Field(False,
                                description="Also write final/merged/: the base model with the adapters merged in, "
                                            "loadable by from_pretrained without peft.")

    @field_validator("target_modules")
    @classmethod
    def _one_name_is_a_list(cls, v):
        # peft reads a string as a regex over full module names ('q_proj' matches nothing);
        # one name typed on the command line (model.lora.target_modules=q_proj) means a suffix.
        return [v] if isinstance(v, str) and v != "all-linear" else v

    @model_validator(mode="after")
    def _targets_given(self):
        targets = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        if not targets or "" in targets:
            raise ValueError("model.lora.target_modules: give 'all-linear' or module-name suffixes such as "
                             "[q_proj,v_proj]")
        if "lm_head" in targets:
            raise ValueError("model.lora.target_modules: lm_head (the output head) cannot take an adapter; "
                             "'all-linear' adapts every other linear layer")
        return self


class ModelConfig(Section):
    path: str = Field("builtin", description="Local Hugging Face model directory (from_pretrained), or 'builtin'.")
    dtype: Literal["fp32", "bf16"] = Field("fp32",
                                           description="Compute dtype. bf16: forward passes under bf16 autocast on "
                                                       "the engine's device (matmuls and attention in bf16); fp32 "
                                                       "stay the master weights, their gradients and every gradient "
                                                       "reduction (FSDP2, DeepSpeed), the optimizer state and step, "
                                                       "log-softmax, log-probs, entropies and values (the bf16 "
                                                       "logits are cast to fp32 first), the loss aggregation and the "
                                                       "canary. The usual setting on GPUs; fp32 on CPU.")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa",
                                                          description="Attention kernel of every forward, packed or "
                                                                      "padded: sdpa (PyTorch's fused kernel; layers "
                                                                      "with attention-logit softcapping, e.g. "
                                                                      "Gemma2, run eager) or eager (scores, softmax "
                                                                      "and weighted sum written out: Hugging Face's "
                                                                      "reference path).")
    trust_remote_code: bool = Field(False,
                                    description="Let from_pretrained run the model directory's own Python code (an "
                                                "auto_map in its config.json or tokenizer_config.json) for the "
                                                "model, tokenizer, reference and critic. false: such a directory is "
                                                "refused in one line; transformers never asks on the terminal.")
    disable_dropout: bool = Field(True,
                                  description="Set every dropout rate of the model to 0 (TRL's disable_dropout): the "
                                              "policy's log-probs must equal the generator's (eval mode) and a "
                                              "verified step needs a deterministic forward. false keeps the model "
                                              "config's dropout (sft only).")
    lora: LoraConfig = LoraConfig()


class DataConfig(Section):
    train: str = Field("builtin",
                       description="Training data: a JSONL file, a Parquet (.parquet) or Arrow (.arrow) file, or a "
                                   "directory written by the datasets library's save_to_disk (those three need pip "
                                   "install 'exactrl[data]'); rows {prompt, completion} or {messages} for SFT, "
                                   "{prompt, answer} for RL.")
    eval: str | None = Field("auto",
                             description="Held-out rows {prompt, answer} for accuracy (a file or directory as "
                                         "data.train), 'builtin' (the built-in problems) or null (no evaluation); "
                                         "'auto' = 'builtin' when data.train is built-in, else no evaluation (with a "
                                         "notice).")
    max_length: int = Field(256, gt=0,
                            description="Longest prompt+completion in tokens; longer rows are an error (or dropped, "
                                        "data.over_length), never truncated silently.")
    max_prompt_length: int | None = Field(None, gt=0,
                                          description="Longest prompt in tokens (rl and eval prompts; sft: the "
                                                      "tokens before the first one learnt); a longer row is an error "
                                                      "naming its file:row and length, or dropped "
                                                      "(data.over_length), never truncated. Unset = only "
                                                      "data.max_length limits.")
    over_length: Literal["error", "drop"] = Field("error",
                                                  description="A row past data.max_length or data.max_prompt_length: "
                                                              "'error' stops the run naming the row and its length; "
                                                              "'drop' leaves it out and says how many rows of which "
                                                              "file were dropped.")
    eval_size: int = Field(2000, gt=0, description="How many eval rows to use (the first N).")
    chat_template: str | None = Field(None,
                                      description="A Jinja chat template, as a file path or the template text "
                                                  "itself, used instead of the tokenizer's own for {messages} rows "
                                                  "and chat-formatted prompts (rl and eval); the run's saved "
                                                  "tokenizer keeps it. A row it fails to render is an error naming "
                                                  "the row and the template. Unset = the tokenizer's.")


class TrainConfig(Section):
    global_batch_size: int = Field(64, gt=0, description="Samples per optimizer step, all ranks together.")
    micro_batch_size: int = Field(16, gt=0, description="Samples per rank per forward/backward.")
    max_steps: int = Field(0, ge=0,
                           description="Optimizer steps; 0 = derive from train.epochs. rl: a multiple of "
                                       "algo.ppo_epochs x algo.mini_batches (whole rollouts).")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data when max_steps is 0.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the full accumulated gradient to this norm (0 = off).")
    padding_free: bool = Field(True,
                               description="Pack each micro-batch's sequences into one row for the training forwards "
                                           "(no compute on padding; attention stays within each sequence). false = "
                                           "right-padded batches.")
    packing_check: Literal["fallback", "error", "off"] = Field("fallback",
                                                               description="Packing self-check before the first "
                                                                           "step: a few sequences packed, padded and "
                                                                           "alone must agree "
                                                                           "(exactrl/checks/packing.py), the probes "
                                                                           "past every length-shaped setting of the "
                                                                           "model (windows, chunks, NoPE temperature "
                                                                           "steps, sparse top-k). fallback: where a "
                                                                           "path disagrees, step down -- packed "
                                                                           "rows, padded batches through exactrl's "
                                                                           "attention, padded batches through the "
                                                                           "model's own attention -- with a notice; "
                                                                           "error: stop; off: skip.")
    packing_check_tol: float = Field(1e-4, gt=0,
                                     description="Allowed max |difference| of the self-check's outputs, relative to "
                                                 "their largest magnitude (fp32 kernels agree to ~1e-6; a wrong mask "
                                                 "is off by 1e-3 or more).")
    generation_check: Literal["fallback", "error", "off"] = Field("fallback",
                                                                  description="Generation self-check before the "
                                                                              "first rollout (rl) or training (sft, "
                                                                              "for its evaluations): exactrl's "
                                                                              "decode loop must pick generate's "
                                                                              "greedy tokens, and the log-probs it "
                                                                              "samples with must equal the training "
                                                                              "forward's "
                                                                              "(exactrl/checks/generation.py). "
                                                                              "fallback: where the loop disagrees, "
                                                                              "decode through Hugging Face's "
                                                                              "generate with a notice; error: stop; "
                                                                              "off: skip.")
    generation_check_tol: float = Field(1e-3, gt=0,
                                        description="Allowed max |sampled log-prob - training forward's log-prob| in "
                                                    "the generation self-check (fp32 decoding agrees with the "
                                                    "training forward to ~1e-6 on most models, 2e-4 on tiny "
                                                    "Nemotron-H, whose Mamba mixer rounds in fp32 inside; a wrong "
                                                    "cache is off by 1e-1 or more).")
    seed: int = Field(0, description="Seeds data order, initialisation of heads and sampling.")
    loss_agg: LossAgg = Field("token-mean",
                              description="How token losses become one loss per optimizer step (see "
                                          "exactrl/losses/aggregation.py).")
    loss_agg_norm: float | None = Field(None, gt=0,
                                        description="Constant length normaliser of seq-mean-token-sum-norm (default: "
                                                    "data.max_length, or rollout.max_new_tokens in RL).")
    log_every: int = Field(10, gt=0, description="Steps between metric log lines.")
    eval_every: int = Field(0, ge=0, description="Steps between evaluations (0 = only at the end).")
    save_every: int = Field(0, ge=0, description="Steps between checkpoints (0 = only the final model).")
    resume_from: str | None = Field(None,
                                    description="A checkpoint-N directory to continue from (model, optimizer, "
                                                "scheduler, RNG, data position), or 'latest': continue this run in "
                                                "its own output_dir (a fixed path, without {time}) from its newest "
                                                "complete checkpoint, or start it from step 0 with a notice when it "
                                                "has none yet -- run the same command again after a preemption.")
    resume_allow_changes: list[str] = Field([],
                                            description="Keys that may differ from the resumed checkpoint's run "
                                                        "config (e.g. [train.global_batch_size]); others refuse the "
                                                        "resume, as exact continuation needs the same data and "
                                                        "layout. Always free: how long to run, logging/saving/eval "
                                                        "cadence, output_dir, eval data, audit.*, log.*, "
                                                        "train.micro_batch_size. Never allowed: model.path, "
                                                        "model.lora.rank, model.lora.target_modules, critic.path "
                                                        "(the checkpoint's tensors depend on them).")
    save_total_limit: int | None = Field(None, gt=0,
                                         description="Keep only the latest N checkpoints (an older one is deleted "
                                                     "after the new one is complete); unset = keep all.")
    gradient_checkpointing: bool = Field(False,
                                         description="Recompute each decoder layer's activations during backward "
                                                     "instead of storing them (Hugging Face's "
                                                     "gradient_checkpointing_enable, non-reentrant): less memory, "
                                                     "about one more forward per step; gradients unchanged.")
    logprob_chunk_size: int = Field(0, ge=0,
                                    description="Tokens per chunk when turning logits into log-probs and entropies: "
                                                "the fp32 log-softmax over the vocabulary is computed chunk by "
                                                "chunk, never for the whole micro-batch at once (log-softmax is per "
                                                "token, so the values and gradients are bit-identical). 0 = one "
                                                "chunk.")
    nonfinite: Literal["error", "skip"] = Field("error",
                                                description="On an inf/NaN gradient norm: 'error' stops the run "
                                                            "(exit 4) before the step is applied; 'skip' applies no "
                                                            "update for that step (counted in metrics as "
                                                            "skipped_nonfinite; the schedule still moves). Weights "
                                                            "that are not finite are never saved. deepspeed: error "
                                                            "only.")


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW) or L2 (SGD).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon (added to the root of the second moment).")
    momentum: float = Field(0.0, ge=0, description="SGD momentum.")
    scheduler: Literal["constant", "linear", "cosine"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to optim.lr.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of optim.lr (linear/cosine).")


class DistributedConfig(Section):
    backend: Literal["single", "fsdp2", "deepspeed"] = Field("single",
                                                             description="Train engine: 'single' (one process), "
                                                                         "'fsdp2' (fully_shard over ranks) or "
                                                                         "'deepspeed' (ZeRO, see deepspeed.*).")
    nproc_per_node: int = Field(1, ge=1,
                                description="Processes to launch on this machine (exactrl re-runs itself under "
                                            "torchrun when > 1).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto",
                                                   description="Where this process's models, batches, KV caches and "
                                                               "collectives live: auto = cuda:LOCAL_RANK when CUDA "
                                                               "is available, else cpu; cuda without a CUDA device "
                                                               "is an error. NCCL on cuda, gloo on cpu.")
    fsdp_cpu_offload: bool = Field(False,
                                   description="distributed.backend=fsdp2: keep the sharded parameters, gradients "
                                               "and optimizer state on the CPU (FSDP2's CPUOffloadPolicy; the "
                                               "optimizer steps there), copying each layer to the device for its "
                                               "compute. For DeepSpeed see deepspeed.offload_*.")



class DeepSpeedConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage (distributed.backend=deepspeed).")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="Optimizer state and step on CPU (ZeRO 1-3).")
    offload_param: Literal["none", "cpu"] = Field("none", description="Parameters on CPU (ZeRO 3).")
    config: str | None = Field(None,
                               description="Your own DeepSpeed JSON; exactrl writes its batch sizes and clipping "
                                           "into it.")


class AuditConfig(Section):
    canary: CheckPolicy = Field("error",
                                description="Per-step check that the gradient carries every micro-batch exactly "
                                            "once: error, warn or off.")
    canary_tol: float = Field(1e-5, gt=0, description="Allowed |canary gradient - 1|.")


class EvalConfig(Section):
    max_new_tokens: int = Field(48, gt=0, description="Generation budget when measuring accuracy.")
    batch_size: int = Field(500, gt=0, description="Prompts decoded together when evaluating.")
    reward_fn: str | None = Field(None,
                                  description="module:function (or http://...) that scores eval answers; accuracy = "
                                              "share with reward >= 1. Unset: rl scores with its first reward.fn (or "
                                              "reward.url); sft with the built-in checker on built-in eval data (an "
                                              "eval file of your own needs it set).")


class WandbConfig(Section):
    project: str | None = Field(None,
                                description="Weights & Biases project to log to (pip install exactrl[wandb]); unset "
                                            "= no W&B (WANDB_PROJECT alone does not switch it on).")
    entity: str | None = Field(None,
                               description="W&B team or user; unset = W&B's own choice (WANDB_ENTITY, else your "
                                           "default entity).")
    name: str | None = Field(None, description="W&B run name; unset = WANDB_NAME, else <run directory name>-<command>.")
    mode: Literal["online", "offline"] | None = Field(None,
                                                      description="offline: write the W&B run only under "
                                                                  "<run>/wandb/ (upload later with `wandb sync`); "
                                                                  "online also sends it; unset = W&B's own choice "
                                                                  "(WANDB_MODE, else online).")


class MlflowConfig(Section):
    uri: str | None = Field(None,
                            description="MLflow tracking URI to log to (pip install exactrl[mlflow]): "
                                        "http://host:5000 (checked to answer within a few seconds before the run "
                                        "starts), or file:///abs/path/mlruns for a local store; unset = no MLflow.")
    experiment: str = Field("exactrl", description="MLflow experiment (created if missing).")


class LogConfig(Section):
    tensorboard: bool = Field(False,
                              description="Also write the metrics.jsonl scalars as TensorBoard events under "
                                          "<run>/tensorboard/ (pip install exactrl[tensorboard]).")
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()


class CommonConfig(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    distributed: DistributedConfig = DistributedConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    audit: AuditConfig = AuditConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    output_dir: str = Field("runs/{command}-{time}", description="Run directory; {command} and {time} are filled in.")

    @model_validator(mode="after")
    def _batch_sizes_divide(self):
        check_layout(self, self.distributed.nproc_per_node)
        return self

    @model_validator(mode="after")
    def _latest_needs_a_fixed_output_dir(self):
        if self.train.resume_from == "latest" and "{time}" in self.output_dir:
            raise ValueError("train.resume_from=latest continues the run in output_dir, but "
                             f"output_dir={self.output_dir!r} names a new directory each launch ({{time}}); set a "
                             "fixed one such as output_dir=runs/my-run")
        return self


def check_layout(cfg: CommonConfig, world: int) -> None:
    """Batch sizes and backend that fit ``world`` ranks (checked again against the launcher's
    real world size before any model loads)."""
    if world > 1 and cfg.distributed.backend == "single":
        raise ValueError(f"{world} processes need a distributed backend: set distributed.backend=fsdp2")
    if cfg.deepspeed.offload_param != "none" and cfg.deepspeed.zero_stage != 3:
        raise ValueError(f"deepspeed.offload_param={cfg.deepspeed.offload_param} needs deepspeed.zero_stage=3 "
                         f"(given {cfg.deepspeed.zero_stage})")
    t = cfg.train
    if t.nonfinite == "skip" and cfg.distributed.backend == "deepspeed":
        raise ValueError("train.nonfinite=skip needs distributed.backend single or fsdp2: DeepSpeed applies its step "
                         "before the gradient can be checked (use train.nonfinite=error)")
    if t.global_batch_size % (t.micro_batch_size * world):
        raise ValueError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                         f"train.micro_batch_size x world size = {t.micro_batch_size} x {world}")


class SFTConfig(CommonConfig):
    """`exactrl sft`: supervised fine-tuning, loss on completion tokens only."""

    @model_validator(mode="after")
    def _eval_file_has_a_scorer(self):
        if self.data.eval not in (None, "auto", "builtin") and self.eval.reward_fn is None:
            raise ValueError(f"data.eval={self.data.eval} needs eval.reward_fn=module:function to score it (sft has "
                             "no reward.fn; the built-in checker only reads the built-in task's '#### n' answers), "
                             "or data.eval=null")
        return self


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


RL_ALGOS = ("ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo")
# Algorithms whose baseline is the other responses to the same prompt.
GROUP_ALGOS = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp_baseline", "gspo")


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
                                description="Divide group-centred rewards by the group std (grpo, gspo); dr_grpo "
                                            "never does.")
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
    if prompts % world:
        raise ValueError(f"a rollout of {prompts} prompts (train.global_batch_size x algo.mini_batches / "
                         f"algo.group_size) does not spread evenly over {world} ranks; each rank samples whole groups "
                         "for an equal share")


class EvalModelConfig(Section):
    path: str | None = Field(None,
                             description="The model to evaluate: a run's final/, checkpoint-N/ or final/merged/, a "
                                         "LoRA run's adapter directory (final/ or checkpoint-N/, on the base its "
                                         "adapter_config.json records), any local Hugging Face causal LM directory, "
                                         "or 'builtin' / 'builtin-sft'. Required.")
    base: str | None = Field(None,
                             description="A LoRA adapter's base model directory; unset = the one the adapter's "
                                         "adapter_config.json records.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto",
                                                   description="Where the model generates: auto = cuda when "
                                                               "available, else cpu.")
    trust_remote_code: bool = Field(False,
                                    description="Let from_pretrained run the model directory's own Python code (an "
                                                "auto_map), as model.trust_remote_code of a training run; false: "
                                                "such a directory is refused in one line.")


class EvalDataConfig(Section):
    eval: str = Field("builtin",
                      description="The eval set: {prompt, answer} rows (prompt: text or chat messages) in a file or "
                                  "directory as data.train of a training run takes (JSONL, Parquet, Arrow, "
                                  "save_to_disk), or 'builtin' (the built-in problems).")
    eval_size: int = Field(2000, gt=0,
                           description="How many eval rows to use (the first N), as data.eval_size of a training run.")
    max_length: int = Field(256, gt=0,
                            description="Longest prompt in tokens; longer rows are an error (or dropped, "
                                        "data.over_length), never truncated silently.")
    max_prompt_length: int | None = Field(None, gt=0,
                                          description="Longest prompt in tokens, as data.max_prompt_length of a "
                                                      "training run. Unset = only data.max_length limits.")
    over_length: Literal["error", "drop"] = Field("error",
                                                  description="A prompt past data.max_length or "
                                                              "data.max_prompt_length: 'error' stops naming the row "
                                                              "and its length; 'drop' leaves it out and says how "
                                                              "many were dropped (accuracy is then over the rest).")
    chat_template: str | None = Field(None,
                                      description="A Jinja chat template (a file path or the text) used instead of "
                                                  "the tokenizer's own for chat-formatted prompts, as "
                                                  "data.chat_template of a training run. Unset = the tokenizer's.")


class PassAtKConfig(Section):
    n: int = Field(0, ge=0,
                   description="Sampled responses per prompt for pass@k (0 = greedy accuracy only); must be >= every "
                               "k.")
    k: list[int] = Field([1],
                         description="The k of pass@k, each estimated without bias from the n samples (Chen et al. "
                                     "2021): the mean over prompts of 1 - C(n-c, k) / C(n, k), c the prompt's "
                                     "correct samples.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the pass@k samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the pass@k samples.")
    seed: int = Field(0, description="Seeds the pass@k samples.")


class EvalScoringConfig(EvalConfig):
    reward_fn: str | None = Field(None,
                                  description="module:function (or http://...) that scores each answer, as reward.fn "
                                              "takes; accuracy = share with reward >= 1. Unset: the built-in checker "
                                              "(data.eval=builtin only).")


class EvalCommandConfig(Section):
    """`exactrl eval`: a model, an eval set and a reward -> greedy accuracy with its 95% interval, pass@k, a report."""

    model: EvalModelConfig = EvalModelConfig()
    data: EvalDataConfig = EvalDataConfig()
    eval: EvalScoringConfig = Field(default_factory=EvalScoringConfig,
                                    description="Generation budget, batch size and the reward, as in a training "
                                                "run's final evaluation.")
    pass_at_k: PassAtKConfig = PassAtKConfig()
    output_dir: str = Field("runs/{command}-{time}",
                            description="Report directory (results.json, report.md, samples.jsonl); {command} and "
                                        "{time} are filled in.")

    @model_validator(mode="after")
    def _scorable(self):
        if self.data.eval != "builtin" and self.eval.reward_fn is None:
            raise ValueError(f"data.eval={self.data.eval} needs eval.reward_fn=module:function to score it "
                             "(the built-in checker only reads the built-in task's '#### n' answers)")
        p = self.pass_at_k
        if p.n and (not p.k or min(p.k) < 1 or max(p.k) > p.n):
            raise ValueError(f"pass_at_k.k={p.k}: each k must be between 1 and pass_at_k.n={p.n}")
        unused = [f"pass_at_k.{k}" for k in sorted(p.model_fields_set) if k != "n" and getattr(
            p, k) != PassAtKConfig.model_fields[k].default]
        if not p.n and unused:
            raise ValueError(f"{', '.join(unused)} set, but pass_at_k.n=0 draws no samples; set pass_at_k.n (samples "
                             "per prompt)")
        return self


class TaskConfig(Section):
    seed: int = Field(0, description="Seed of the problems, the SFT style mix and the initial model.")
    digits: int = Field(3, ge=1, le=6, description="Digits per operand.")
    direct_fraction: float = Field(0.5, ge=0, le=1,
                                   description="The SFT teacher tends to skip the working when the first operand's "
                                               "last digit is below 10 x this (see exactrl/tasks/arithmetic.py).")
    skip_prob: float = Field(0.75, ge=0, le=1, description="How often the teacher skips the working on those problems.")
    n_sft: int = Field(20000, gt=0, description="SFT demonstrations.")
    n_rl: int = Field(20000, gt=0, description="RL prompts (disjoint from the SFT problems).")
    n_eval: int = Field(2000, gt=0, description="Held-out problems (disjoint from both).")


def _demo_sft() -> SFTConfig:
    # 800 steps of 64: past the phase change where the tiny model learns to read the right
    # digits, so the worked style is nearly always right while the habit problems stay direct
    # and mostly wrong: room for RL that SFT alone does not fill.
    return SFTConfig(
        data=DataConfig(eval_size=500),
        train=TrainConfig(global_batch_size=64, micro_batch_size=32, max_steps=800, log_every=10, eval_every=200),
        optim=OptimConfig(lr=3e-3, warmup_steps=20, scheduler="cosine"),
    )


def _demo_rl() -> RLConfig:
    # 16 prompts x 8 samples per step. lr 1e-4 is stable here; 3e-4 collapsed the SFT model
    # (FACTS.md saw the same with TRL's GRPO at this scale).
    return RLConfig(
        data=DataConfig(eval_size=500),
        train=TrainConfig(global_batch_size=128, micro_batch_size=64, max_steps=40, log_every=1, eval_every=10),
        optim=OptimConfig(lr=1e-4, warmup_steps=5, scheduler="constant"),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=48),
        algo=AlgoConfig(group_size=8),
    )


class DemoConfig(Section):
    """`exactrl demo`: built-in task, tiny model, SFT then GRPO, accuracy before/after."""

    task: TaskConfig = TaskConfig()
    sft: SFTConfig = Field(default_factory=_demo_sft,
                           description="The SFT phase (model and data are the built-in task's).")
    rl: RLConfig = Field(default_factory=_demo_rl, description="The GRPO phase, from the SFT model.")
    output_dir: str = Field("runs/demo-{time}", description="Run directory; {time} is filled in.")

    @model_validator(mode="before")
    @classmethod
    def _no_latest(cls, data):
        # Before the phases' own checks: the demo runs both in a run directory of its own.
        for phase in ("sft", "rl"):
            section = data.get(phase) if isinstance(data, dict) else None
            train = section.get("train") if isinstance(section, dict) else None
            if isinstance(train, dict) and train.get("resume_from") == "latest":
                raise ValueError(f"{phase}.train.resume_from=latest: the demo runs its phases in a new run directory "
                                 f"each time, so there is no run to continue; continue a run with `exactrl {phase}` "
                                 "instead")
        return data

    @model_validator(mode="after")
    def _full_models(self):
        if self.sft.model.lora.rank or self.rl.model.lora.rank:
            raise ValueError("sft.model.lora.rank / rl.model.lora.rank: the demo hands full models from phase to "
                             "phase; train LoRA adapters with `exactrl sft` or `exactrl rl`")
        return self
