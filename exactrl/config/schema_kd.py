"""`exactrl kd`'s config: SFT's (the same data, the same NLL) plus the kd section: a frozen teacher whose
next-token distribution the student also matches, token by token (exactrl/losses/kd.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.schema import Section, SFTConfig

# exactrl/losses/distill.py's full-distribution divergences, named here so that reading a config imports no torch
KD_LOSSES = ("forward_kl", "reverse_kl", "jsd", "topk_forward_kl")


class KDSection(Section):
    teacher: str = Field("builtin-sft", description="The frozen teacher: a model directory in Hugging Face format, or "
                                                    "builtin-sft (the built-in model after SFT). It must share the "
                                                    "student's tokenizer and vocabulary size: the divergence compares "
                                                    "the two models' distributions over the same token ids.")
    loss: Literal[KD_LOSSES] = Field(
        "forward_kl", description="The divergence to the teacher at each loss token (docs/algorithms/distillation.md): "
                                  "forward_kl KL(p_T || p_S) (supervised KD), reverse_kl KL(p_S || p_T), jsd GKD's "
                                  "generalised JSD with kd.beta, topk_forward_kl KL to the teacher renormalised over "
                                  "its kd.top_k most likely tokens (keeps k numbers per token instead of the "
                                  "vocabulary).")
    alpha: float = Field(0.5, gt=0, le=1, description="The loss is (1 - alpha) NLL + alpha divergence, both token "
                                                      "losses under the step's one normaliser (train.loss_agg); 1: "
                                                      "distillation alone.")
    temperature: float = Field(1.0, gt=0, description="Both models' logits are divided by it before the softmax of the "
                                                      "divergence (TRL's GKD; no T^2 factor: scale kd.alpha instead). "
                                                      "The NLL stays at temperature 1.")
    beta: float = Field(0.5, ge=0, le=1, description="kd.loss=jsd: GKD's beta, the mixture M = beta p_T + (1 - beta) "
                                                     "p_S; 0 is the forward KL, 1 the reverse KL (TRL's convention).")
    top_k: int = Field(20, ge=1, description="kd.loss=topk_forward_kl: the teacher's most likely tokens kept per "
                                             "position.")


class KDConfig(SFTConfig):
    """`exactrl kd`: a student trained on SFT data toward a frozen teacher's distribution, mixed with the NLL."""

    kd: KDSection = KDSection()

    @model_validator(mode="after")
    def _knobs_are_read(self):
        k, default = self.kd, KDSection()
        if k.beta != default.beta and k.loss != "jsd":
            raise ValueError(f"kd.beta={k.beta} is set, but kd.loss={k.loss} does not read it (only jsd does); unset "
                             "kd.beta")
        if k.top_k != default.top_k and k.loss != "topk_forward_kl":
            raise ValueError(f"kd.top_k={k.top_k} is set, but kd.loss={k.loss} does not read it (only topk_forward_kl "
                             "does); unset kd.top_k")
        return self
