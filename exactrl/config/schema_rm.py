"""`exactrl rm`'s config: a reward model (the policy's architecture with a scalar head) trained on preference
pairs with the Bradley-Terry loss, each pair a unit of the step (losses/pairs.py ScoreTerm), or (rm.kind=process)
a process reward model on step-labelled rows, per-step binary cross-entropy (losses/process.py ProcessTerm). With
model.lora.rank > 0 the body trains LoRA adapters and the scalar head trains whole; final/ is the merged model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.schema import CommonConfig, EvalConfig, Section
from exactrl.config.schema_pref import PrefDataConfig, PrefTrainConfig


class RMDataConfig(PrefDataConfig):
    train: str = Field("builtin", description="Preference pairs {prompt, chosen, rejected} (text, or TRL's chat "
                                              "forms), or with rm.kind=process step-labelled rows {prompt, "
                                              "completions: [step...], labels: [true|false per step]} (TRL's "
                                              "stepwise supervision): a JSONL, Parquet or Arrow file (or a "
                                              "save_to_disk directory), or 'builtin': the built-in task's pairs (a "
                                              "worked, correct solution against a wrong answer) or step-labelled "
                                              "worked solutions.")
    eval: str | None = Field("auto", description="Held-out rows as data.train for the final pairwise accuracy (rm."
                                                 "kind=process: step accuracy and first-wrong-step accuracy), "
                                                 "'builtin' (the built-in task's held-out set) or null (none); "
                                                 "'auto' = 'builtin' when data.train is built-in, else none (with a "
                                                 "notice).")


class RMSection(Section):
    kind: Literal["pairwise", "process"] = Field(
        "pairwise", description="pairwise: a Bradley-Terry reward model on preference pairs, one score per answer. "
                                "process: a process reward model (PRM) on step-labelled rows, one score per step at "
                                "its separator, binary cross-entropy against the step's label over all labelled "
                                "steps of the optimizer step (train.loss_agg=token-mean); train.global_batch_size "
                                "and train.micro_batch_size then count rows.")
    step_separator: str | None = Field(None, description="rm.kind=process: the text after each step, at whose last "
                                                         "token the step is scored (TRL's step_separator); unset = "
                                                         "' ' for the built-in steps (how its worked solutions "
                                                         "separate them), else '\\n' (TRL's default).")
    margin: bool = Field(False, description="Subtract each pair's 'margin' column inside the loss, -log sigma(r_c - "
                                            "r_r - margin) (Llama 2's reward model); every training pair must then "
                                            "carry one. false: the column is not read.")
    stats_pairs: int = Field(2000, gt=0, description="How many training pairs (rm.kind=process: rows; the first N) "
                                                     "the final model scores for the mean and std saved in "
                                                     "final/reward_stats.json.")
    center_rewards: float = Field(0.0, ge=0, description="Weight of (r_c + r_r)^2 per pair, which centres the "
                                                         "rewards on 0 (Eisenstein et al. 2023; TRL's "
                                                         "center_rewards_coefficient, 0.01 in its docs); 0 = off.")


class RMConfig(CommonConfig):
    """`exactrl rm`: a Bradley-Terry reward model on preference pairs, normalised over all pairs of each step, or
    (rm.kind=process) a process reward model on step-labelled rows, normalised over all labelled steps of each step."""

    data: RMDataConfig = RMDataConfig()
    train: PrefTrainConfig = PrefTrainConfig()
    rm: RMSection = RMSection()

    @model_validator(mode="after")
    def _scored_not_decoded(self):
        # With LoRA the head trains whole beside the adapters and final/ is always the merged reward model
        # (exactrl/models/lora.py merged_only): merge_on_save would change nothing.
        if self.model.lora.rank > 0 and self.model.lora.merge_on_save:
            raise ValueError("model.lora.merge_on_save=true is set, but exactrl rm always saves its final reward model "
                             "with the adapters merged in (a plain reward model in final/); unset it")
        changed = [k for k, v in self.eval.model_dump().items() if v != EvalConfig().model_dump()[k]]
        if changed:  # a reward model is evaluated by scoring pairs, never by generating
            raise ValueError(f"eval.{changed[0]} is set, but exactrl rm decodes nothing: its evaluation is the "
                             "pairwise accuracy on data.eval's pairs, scored in train.micro_batch_size pairs; unset it")
        return self
