"""`exactrl dpo`'s config: a policy trained on preference pairs against a frozen reference
(the DPO family of exactrl/losses/preference.py), each pair a unit of the step (losses/pairs.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.schema import CommonConfig, DataConfig, Section, TrainConfig

CACHE_MODES = ("none", "precompute")  # dpo/kto reference_cache (exactrl/workers/reference_cache.py)

# The pair losses a policy trains with (losses/preference.py PAIR_LOSSES; "bt" scores a reward model's head).
POLICY_PAIR_LOSSES = ("dpo", "robust", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


class PrefDataConfig(DataConfig):
    train: str = Field("builtin",
                       description="Preference pairs: a JSONL, Parquet or Arrow file (or a save_to_disk directory) "
                                   "of rows {prompt, chosen, rejected} (text, or TRL's chat forms), or 'builtin': "
                                   "the built-in task's pairs (a worked, correct solution against a wrong answer).")


def eval_pairs_field(what: str):
    return Field("auto", description=f"Held-out preference pairs (rows {{prompt, chosen, rejected}}) on which the "
                                     f"final {what} is scored: the share of pairs whose chosen answer's implicit "
                                     "reward beats the rejected one's, with a Wilson 95% interval; 'builtin' (the "
                                     "built-in task's held-out pairs), null (none), or 'auto' = 'builtin' when "
                                     "data.train is built-in, else none.")


class DPODataConfig(PrefDataConfig):
    eval_pairs: str | None = eval_pairs_field("policy")


class PrefTrainConfig(TrainConfig):
    global_batch_size: int = Field(32, gt=0, description="Preference pairs per optimizer step, all ranks together "
                                                         "(each pair is two sequences, never split).")
    micro_batch_size: int = Field(8, gt=0, description="Pairs per forward/backward on one rank.")


class ReferenceSection(Section):
    """The frozen reference of dpo and kto, and its cache."""

    reference: str | None = Field(None, description="The frozen reference model's directory; unset = model.path "
                                                    "(with LoRA: the policy with its adapters off, so it cannot be "
                                                    "set).")
    reference_cache: Literal[CACHE_MODES] = Field(
        "none", description="'precompute': the reference's log-probs of every sequence the run reads, computed once "
                            "before training (a progress bar; every rank a share) and kept in reference_cache_dir "
                            "under a digest of the reference's files, the tokenised data and model.dtype / "
                            "attention / packing, so a later run with the same three runs no reference forward "
                            "(TRL's precompute_ref_log_probs). 'none': the reference scores each step's sequences "
                            "in the step's micro-batches.")
    reference_cache_dir: str | None = Field(None, description="Where reference_cache=precompute keeps its files "
                                                              "(on a filesystem every rank reads); unset = "
                                                              "reference-cache/ beside the run directory.")

    def check_reference(self, section: str, lora_rank: int) -> None:
        if self.reference is not None and lora_rank > 0:
            raise ValueError(f"{section}.reference={self.reference}: with model.lora.rank={lora_rank} the reference is "
                             f"the policy's base model with its adapters off; unset {section}.reference")
        if self.reference_cache_dir is not None and self.reference_cache == "none":
            raise ValueError(f"{section}.reference_cache_dir is set, but {section}.reference_cache=none keeps no "
                             f"cache; set {section}.reference_cache=precompute or unset it")


class DPOSection(ReferenceSection):
    loss: Literal[POLICY_PAIR_LOSSES] = Field("dpo", description="The pair loss (docs/algorithms/preference.md): dpo "
                                              "(sigmoid; conservative DPO with dpo.label_smoothing), robust, ipo, "
                                              "simpo and orpo (these two reference-free).")
    beta: float = Field(0.1, gt=0, description="DPO's beta (IPO's tau, SimPO's beta: its paper uses 2 to 10).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: conservative DPO's label noise; robust: "
                                                                  "robust DPO's flip rate.")
    gamma: float = Field(0.5, description="simpo: the target reward margin, absolute (the paper's eq. 6; TRL's "
                                          "simpo_gamma).")
    ipo_length_normalized: bool = Field(True, description="ipo: on per-token (average) log-ratios, as TRL; false "
                                                          "sums them, as OpenRLHF.")
    orpo_lambda: float = Field(0.1, ge=0, description="orpo: the odds-ratio term's weight beside the NLL.")
    nll_coef: float | None = Field(None, ge=0, description="Weight of an NLL term on the chosen answers, normalised "
                                                           "over the step's chosen tokens (RPO's alpha); unset = 1 "
                                                           "for orpo (its NLL), 0 otherwise.")
    def nll(self) -> float:
        return (1.0 if self.loss == "orpo" else 0.0) if self.nll_coef is None else self.nll_coef


class DPOConfig(CommonConfig):
    """`exactrl dpo`: a policy trained on preference pairs, normalised over all pairs of each step."""

    data: DPODataConfig = DPODataConfig()
    train: PrefTrainConfig = PrefTrainConfig()
    dpo: DPOSection = DPOSection()

    @model_validator(mode="after")
    def _reference_is_used(self):
        d = self.dpo
        if d.loss in REFERENCE_FREE and d.reference is not None:
            raise ValueError(f"dpo.reference={d.reference}: dpo.loss={d.loss} is reference-free; unset dpo.reference")
        if d.loss in REFERENCE_FREE and d.reference_cache != "none":
            raise ValueError(f"dpo.reference_cache={d.reference_cache}: dpo.loss={d.loss} is reference-free; unset "
                             "dpo.reference_cache")
        d.check_reference("dpo", self.model.lora.rank)
        if self.data.eval not in (None, "auto", "builtin") and self.eval.reward_fn is None:
            raise ValueError(f"data.eval={self.data.eval} needs eval.reward_fn=module:function to score it, or "
                             "data.eval=null")
        return self


# `exactrl kto`: unpaired rows {prompt, completion, label}, each a sample of the step (losses/kto.py).
class UnpairedDataConfig(DataConfig):
    train: str = Field("builtin",
                       description="Unpaired rows: a JSONL, Parquet or Arrow file (or a save_to_disk directory) of "
                                   "rows {prompt, completion, label: true|false} (text, or TRL's chat form), or "
                                   "'builtin': the built-in task's rows (a worked, correct solution is desirable, a "
                                   "wrong answer undesirable).")
    eval_pairs: str | None = eval_pairs_field("policy (KTO's implicit reward, beta times its log-ratio)")


class KTOSection(ReferenceSection):
    beta: float = Field(0.1, gt=0, description="KTO's beta (the paper's default 0.1).")
    desirable_weight: float = Field(1.0, gt=0, description="w_d, the weight of a desirable row's loss (the paper "
                                                           "keeps w_d n_d / (w_u n_u) in [1, 4/3]).")
    undesirable_weight: float = Field(1.0, gt=0, description="w_u, the weight of an undesirable row's loss.")
    z: Literal["step", "micro_batch"] = Field(
        "step", description="KTO's reference point z: 'step', from the whole step's mismatched pairs (a no-grad "
                            "pre-pass; the update does not depend on micro-batch size or world size); "
                            "'micro_batch', each micro-batch's own, averaged over the ranks' (TRL's; to compare).")


class KTOConfig(CommonConfig):
    """`exactrl kto`: a policy trained on unpaired desirable/undesirable rows, z over each whole step."""

    data: UnpairedDataConfig = UnpairedDataConfig()
    kto: KTOSection = KTOSection()

    @model_validator(mode="after")
    def _eval_is_scored(self):
        self.kto.check_reference("kto", self.model.lora.rank)
        if self.data.eval not in (None, "auto", "builtin") and self.eval.reward_fn is None:
            raise ValueError(f"data.eval={self.data.eval} needs eval.reward_fn=module:function to score it, or "
                             "data.eval=null")
        return self
