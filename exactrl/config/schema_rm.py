"""`exactrl rm`'s config: a reward model (the policy's architecture with a scalar head) trained on preference
pairs with the Bradley-Terry loss, each pair a unit of the step (losses/pairs.py ScoreTerm)."""

from __future__ import annotations

from pydantic import Field, model_validator

from exactrl.config.schema import CommonConfig, EvalConfig, Section
from exactrl.config.schema_pref import PrefDataConfig, PrefTrainConfig


class RMDataConfig(PrefDataConfig):
    eval: str | None = Field("auto", description="Held-out preference pairs for the final pairwise accuracy (rows "
                                                 "as data.train), 'builtin' (the built-in task's held-out pairs) or "
                                                 "null (none); 'auto' = 'builtin' when data.train is built-in, else "
                                                 "none (with a notice).")


class RMSection(Section):
    margin: bool = Field(False, description="Subtract each pair's 'margin' column inside the loss, -log sigma(r_c - "
                                            "r_r - margin) (Llama 2's reward model); every training pair must then "
                                            "carry one. false: the column is not read.")
    stats_pairs: int = Field(2000, gt=0, description="How many training pairs (the first N) the final model scores "
                                                     "for the mean and std saved in final/reward_stats.json.")
    center_rewards: float = Field(0.0, ge=0, description="Weight of (r_c + r_r)^2 per pair, which centres the "
                                                         "rewards on 0 (Eisenstein et al. 2023; TRL's "
                                                         "center_rewards_coefficient, 0.01 in its docs); 0 = off.")


class RMConfig(CommonConfig):
    """`exactrl rm`: a Bradley-Terry reward model on preference pairs, normalised over all pairs of each step."""

    data: RMDataConfig = RMDataConfig()
    train: PrefTrainConfig = PrefTrainConfig()
    rm: RMSection = RMSection()

    @model_validator(mode="after")
    def _full_model(self):
        if self.model.lora.rank > 0:
            raise ValueError(f"model.lora.rank={self.model.lora.rank}: exactrl rm trains the whole reward model "
                             "(LoRA on its head is not supported); set model.lora.rank=0")
        changed = [k for k, v in self.eval.model_dump().items() if v != EvalConfig().model_dump()[k]]
        if changed:  # a reward model is evaluated by scoring pairs, never by generating
            raise ValueError(f"eval.{changed[0]} is set, but exactrl rm decodes nothing: its evaluation is the "
                             "pairwise accuracy on data.eval's pairs, scored in train.micro_batch_size pairs; unset it")
        return self
