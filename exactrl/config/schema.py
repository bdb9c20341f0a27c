"""Typed configuration, one tree per command. Every field is documented where it is declared.

``model.path`` / ``data.*`` accept ``builtin`` to mean the built-in task, model and data
(built locally on first use, see exactrl/tasks/builtin.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# YAML 1.1 reads a bare `off` as false; accept it as the word the user meant.
CheckPolicy = Annotated[Literal["error", "warn", "off"], BeforeValidator(lambda v: "off" if v is False else v)]
SelfCheck = Annotated[Literal["fallback", "error", "off"], BeforeValidator(lambda v: "off" if v is False else v)]
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
    packed_kernel: Literal["auto", "flash", "torch_varlen", "flex", "gather"] = Field(
        "auto", description="Attention kernel of packed rows (train.padding_free): auto takes the first that can run "
                            "the layer -- flash (flash-attn's varlen, when installed; CUDA, bf16/fp16), torch_varlen "
                            "(torch.nn.attention.varlen, CUDA, bf16/fp16), flex (flex_attention with a per-sequence "
                            "block mask, compiled; CUDA) -- else gather (each sequence gathered into a padded block "
                            "for SDPA/eager; the CPU's path). One kernel named: that one where it can run, else "
                            "gather. The packing self-check compares whichever runs and turns off one that "
                            "disagrees (exactrl/models/varlen_kernels.py).")
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
    packing_check: SelfCheck = Field("fallback",
                                                               description="Packing self-check before the first "
                                                                           "step: a batch shaped like the run's "
                                                                           "(rows padded beside the longest, past "
                                                                           "every length-shaped setting of the "
                                                                           "model: windows, chunks, NoPE temperature "
                                                                           "steps, sparse top-k) packed, padded and "
                                                                           "each sequence alone must agree "
                                                                           "(exactrl/checks/packing.py). fallback: "
                                                                           "where a "
                                                                           "path disagrees, step down -- packed "
                                                                           "rows, padded batches through exactrl's "
                                                                           "attention, padded batches through the "
                                                                           "model's own attention -- with a notice; "
                                                                           "error: stop; off: skip.")
    packing_check_tol: float = Field(1e-4, gt=0,
                                     description="Allowed max |difference| of the self-check's outputs, relative to "
                                                 "their largest magnitude (fp32 kernels agree to ~1e-6; a wrong mask "
                                                 "is off by 1e-3 or more).")
    generation_check: SelfCheck = Field("fallback",
                                                                  description="Generation self-check before the "
                                                                              "first rollout (rl) or training (sft, "
                                                                              "for its evaluations): the decoder "
                                                                              "must pick the greedy tokens generate "
                                                                              "picks on unpadded prompts, and the "
                                                                              "log-probs it samples with must equal "
                                                                              "the training forward's "
                                                                              "(exactrl/rollout/generation_check.py). "
                                                                              "fallback: where it disagrees, step "
                                                                              "down -- exactrl's decode loop, "
                                                                              "Hugging Face's generate, generate on "
                                                                              "the prompts of each length apart -- "
                                                                              "with a notice; error: stop; off: "
                                                                              "skip. Where none matches, rl stops "
                                                                              "unless algo.rollout_correction "
                                                                              "corrects the gap.")
    generation_check_tol: float = Field(1e-3, gt=0,
                                        description="Allowed max |sampled log-prob - training forward's log-prob| in "
                                                    "the generation self-check (fp32 decoding agrees with the "
                                                    "training forward to ~1e-6; a wrong cache is off by 1e-1 or "
                                                    "more; Nemotron-H's one-token step, which leaves out its "
                                                    "scan's limit on the step size, by 1e-4 to 1e-2).")
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
    compile: bool = Field(False,
                          description="Compile each decoder layer's training forward with torch.compile (inductor, "
                                      "dynamic shapes: packed rows of every length share one compile; "
                                      "exactrl/distributed/compile.py): fused kernels, fewer launches on a GPU, for a "
                                      "compile of each layer kind at the first step (seconds to a minute or two). "
                                      "Attention, the output head and the loss stay eager; so do no-grad passes "
                                      "(old and reference log-probs, decoding). Inductor's fusions round in another "
                                      "order: weights drift from an eager run's by fp32 (bf16 under model.dtype=bf16) "
                                      "rounding, as between two GPUs. Not with distributed.backend=deepspeed.")
    logprob_chunk_size: int = Field(2048, ge=0,
                                    description="Tokens per chunk of the output head: the head's matmul and the fp32 "
                                                "log-softmax run chunk by chunk, forward and (recomputed) backward, "
                                                "so a micro-batch's [tokens x vocabulary] logits never exist "
                                                "(exactrl/models/head.py; a micro-batch of at most this many tokens "
                                                "runs the plain path's operations). Models whose logits the head "
                                                "self-check cannot reproduce, and fields over the whole vocabulary "
                                                "(distillation's logits), take the full logits, log-softmax still in "
                                                "chunks of this size. 0 = the full logits, one log-softmax.")
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


class FaultConfig(Section):
    dropped_micro_batches: bool = Field(False,
                                        description="Reproduce on purpose DeepSpeed's ZeRO-2 CPU-offload bug "
                                                    "(0.15.2-0.18.x): the optimizer sees only the first and last "
                                                    "micro-batch of each step, as (g_first + g_last)/K, on any "
                                                    "backend (exactrl/config/faults.py). Needs K = global / (micro x "
                                                    "world) >= 3 and the canary on: it stops the run unless "
                                                    "audit.canary=warn, which counts the steps it flags "
                                                    "(canary_fired). Labelled in every output.")
    mean_of_means: bool = Field(False,
                                description="Reproduce on purpose OpenRLHF's mean-of-means loss (<= 0.10.2): each "
                                            "micro-batch's loss normalised by its own tokens (sequences), then "
                                            "averaged over the step's micro-batches of all ranks. Needs more than "
                                            "one micro-batch per step; the canary cannot see it (every "
                                            "micro-batch still arrives once). Labelled in every output.")


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
    fault: FaultConfig = FaultConfig()
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
    check_faults(cfg, world)


def check_faults(cfg: CommonConfig, world: int) -> None:
    """A fault that would change nothing, or that the canary could not stop, is refused."""
    t, k = cfg.train, cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)
    if cfg.fault.dropped_micro_batches and k < 3:
        raise ValueError(f"fault.dropped_micro_batches drops the middle micro-batches of each step, but "
                         f"train.global_batch_size / (train.micro_batch_size x world size) = {t.global_batch_size} / "
                         f"({t.micro_batch_size} x {world}) gives K={k} per rank (the bug needs K >= 3); lower "
                         "train.micro_batch_size")
    if cfg.fault.dropped_micro_batches and cfg.audit.canary == "off":
        raise ValueError("fault.dropped_micro_batches with audit.canary=off: the canary must see the injected bug; "
                         "set audit.canary=warn to run through it (counted as canary_fired) or leave it at error")
    if cfg.fault.mean_of_means and t.global_batch_size == t.micro_batch_size:
        raise ValueError(f"fault.mean_of_means averages the means of a step's micro-batches, but "
                         f"train.global_batch_size = train.micro_batch_size = {t.micro_batch_size} makes one "
                         "micro-batch per step; lower train.micro_batch_size")


class SFTConfig(CommonConfig):
    """`exactrl sft`: supervised fine-tuning, loss on completion tokens only."""

    @model_validator(mode="after")
    def _eval_file_has_a_scorer(self):
        if self.data.eval not in (None, "auto", "builtin") and self.eval.reward_fn is None:
            raise ValueError(f"data.eval={self.data.eval} needs eval.reward_fn=module:function to score it (sft has "
                             "no reward.fn; the built-in checker only reads the built-in task's '#### n' answers), "
                             "or data.eval=null")
        return self
