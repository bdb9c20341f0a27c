"""The typed configuration of the commands built on the trainers: exactrl eval, the pipeline (SFT
then RL) and the demo (the pipeline on the built-in task)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.schema import DataConfig, EvalConfig, ModelConfig, OptimConfig, Section, SFTConfig, TrainConfig
from exactrl.config.schema_env import TOOL_TASKS, EnvConfig, tool_task_refusal
from exactrl.config.schema_rl import AlgoConfig, RLConfig, RolloutConfig
from exactrl.config.schema_task import TaskConfig


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
    preference: bool = Field(False, description="Also write the samples as preference data beside samples.jsonl: "
                             "pairs.jsonl (each prompt's i-th right sample against its i-th wrong one, in sample "
                             "order; rejected_kind 'sampled') and unpaired.jsonl (every sample, labelled right when "
                             "its reward is >= 1), the rows exactrl rm, dpo and kto read.")


class EvalScoringConfig(EvalConfig):
    reward_fn: str | None = Field(None,
                                  description="module:function (or http://...) that scores each answer, as reward.fn "
                                              "takes; accuracy = share with reward >= 1. Unset: the built-in checker "
                                              "(data.eval=builtin only).")


class EvalCommandConfig(Section):
    """`exactrl eval`: a model, an eval set and a reward -> greedy accuracy with its 95% interval, pass@k, a report.
    With env.* each prompt is answered by a greedy episode (each turn up to eval.max_new_tokens tokens), scored as
    `exactrl rl` scores its evaluation episodes: the steps' rewards plus, with env.reward_fn, the eval reward's
    score of the final turn; the report adds the tool-call rate (episodes with a call) with its 95% interval and the
    episodes' turns, tool errors and tokens, and samples.jsonl holds each episode's turns and observations."""

    model: EvalModelConfig = EvalModelConfig()
    data: EvalDataConfig = EvalDataConfig()
    eval: EvalScoringConfig = Field(default_factory=EvalScoringConfig,
                                    description="Generation budget, batch size and the reward, as in a training "
                                                "run's final evaluation.")
    pass_at_k: PassAtKConfig = PassAtKConfig()
    task: TaskConfig = Field(default_factory=TaskConfig,
                             description="The built-in task model.path=builtin / builtin-sft and data.eval=builtin "
                                         "mean (task.name=calculator: the multi-turn tool task, evaluated with env.*).")
    env: EnvConfig = Field(default_factory=EnvConfig,
                           description="Episodes instead of one-turn answers: an environment answering each greedy "
                                       "turn, as env.* of `exactrl rl`.")
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
        if p.preference and self.env.enabled:
            raise ValueError("pass_at_k.preference with env.*: a sampled episode is several turns and observations, "
                             "not one prompt -> completion pair the preference rows hold; unset one of them")
        return self

    @model_validator(mode="after")
    def _task_is_used(self):
        builtin = self.data.eval == "builtin" or self.model.path in ("builtin", "builtin-sft")
        if self.task.name in TOOL_TASKS and builtin and not self.env.enabled:
            raise ValueError(tool_task_refusal(self.task.name, budget="eval.max_new_tokens",
                                               why="one-turn answers would score every call 0"))
        if self.task != TaskConfig() and not builtin:
            raise ValueError(f"task.* chooses what model.path=builtin / builtin-sft and data.eval=builtin mean, and "
                             f"neither is used (model.path={self.model.path}, data.eval={self.data.eval}); unset "
                             "task.*")
        return self


class TruncateConfig(Section):
    rollouts: int = Field(0, ge=0,
                          description="Truncated SFT-then-RL: the RL phase runs this many rollouts (the papers' "
                                      "'RL steps': one batch of prompts sampled, then algo.ppo_epochs x "
                                      "algo.mini_batches optimizer steps each), replacing rl.train.max_steps / "
                                      "rl.train.epochs; the seed paper's variant is 50 (arXiv 2604.23747, sec. "
                                      "4.3). 0 = off: the rl section's own length.")
    lr: float | None = Field(None, gt=0,
                             description="The truncated RL phase's peak learning rate, replacing rl.optim.lr (the "
                                         "seed paper's 50-step variant: 5e-6, against 1e-6 for 500 steps); unset = "
                                         "rl.optim.lr. Needs truncate.rollouts.")


class PipelineConfig(Section):
    """`exactrl pipeline`: SFT, then RL (any algo.name) from the SFT model, with held-out accuracy before and
    after each phase, their FLOPs and wall time in one summary."""

    sft: SFTConfig = Field(default_factory=SFTConfig, description="The SFT phase, as `exactrl sft` takes it.")
    rl: RLConfig = Field(default_factory=RLConfig,
                         description="The RL phase, as `exactrl rl` takes it; its model is the SFT phase's.")
    truncate: TruncateConfig = TruncateConfig()
    resume: bool = Field(False,
                         description="Continue the pipeline in output_dir (a fixed path, without {time}): a "
                                     "finished phase is kept, never re-run; an interrupted one continues from its "
                                     "newest complete checkpoint (set the phases' train.save_every), or starts "
                                     "again without one.")
    output_dir: str = Field("runs/{command}-{time}",
                            description="Run directory: sft/ and rl/ hold each phase's run (checkpoints, "
                                        "metrics.jsonl, final/); summary.json, report.md and plot.png sit beside "
                                        "them; {command} and {time} are filled in.")

    @model_validator(mode="before")
    @classmethod
    def _phases_own_resume(cls, data):
        # Before the phases' own checks: the pipeline decides where each phase continues from.
        for phase in ("sft", "rl"):
            section = data.get(phase) if isinstance(data, dict) else None
            train = section.get("train") if isinstance(section, dict) else None
            if isinstance(train, dict) and train.get("resume_from") is not None:
                raise ValueError(f"{phase}.train.resume_from={train['resume_from']}: the pipeline continues its "
                                 "phases itself; set resume=true (with a fixed output_dir) to continue a pipeline, "
                                 f"or continue a phase on its own with `exactrl {phase}`")
        return data

    @model_validator(mode="after")
    def _phases_fit(self):
        if self.rl.task != TaskConfig():
            raise ValueError("rl.task: a pipeline's phases share one built-in task (`exactrl demo task.name=...`); "
                             "for another task run `exactrl rl task.name=...` on its own")
        if self.sft.model.lora.rank or self.rl.model.lora.rank:
            raise ValueError("sft.model.lora.rank / rl.model.lora.rank: the pipeline hands full models from phase "
                             "to phase; train LoRA adapters with `exactrl sft` or `exactrl rl`")
        if self.rl.model.path != ModelConfig().path:
            raise ValueError(f"rl.model.path={self.rl.model.path}: the RL phase starts from the SFT phase's model; "
                             "set sft.model.path (the model SFT starts from) instead")
        if self.truncate.lr is not None and not self.truncate.rollouts:
            raise ValueError(f"truncate.lr={self.truncate.lr} needs truncate.rollouts (the truncated phase's "
                             "length); set it, e.g. truncate.rollouts=50, or remove truncate.lr")
        if self.resume and "{time}" in self.output_dir:
            raise ValueError(f"resume=true continues the pipeline in output_dir, but output_dir={self.output_dir!r} "
                             "names a new directory each launch ({time}); set a fixed one such as "
                             "output_dir=runs/my-pipeline")
        return self

    def rl_phase(self) -> RLConfig:
        """The RL phase's config as it runs: truncate.* applied."""
        t = self.truncate
        if not t.rollouts:
            return self.rl.model_copy(deep=True)
        a = self.rl.algo
        rl = self.rl.model_copy(deep=True)
        rl.train.max_steps = t.rollouts * a.ppo_epochs * a.mini_batches
        if t.lr is not None:
            rl.optim.lr = t.lr
        return rl


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


class DemoConfig(PipelineConfig):
    """`exactrl demo`: the pipeline on the built-in task and tiny model, SFT then GRPO, accuracy before/after."""

    task: TaskConfig = TaskConfig()
    sft: SFTConfig = Field(default_factory=_demo_sft,
                           description="The SFT phase (model and data are the built-in task's).")
    rl: RLConfig = Field(default_factory=_demo_rl, description="The GRPO phase, from the SFT model.")
    output_dir: str = Field("runs/demo-{time}", description="Run directory; {time} is filled in.")

    @model_validator(mode="after")
    def _tool_task_has_its_environment(self):
        if self.task.name in TOOL_TASKS and not self.rl.env.enabled:
            raise ValueError(tool_task_refusal(self.task.name, "rl."))
        return self
