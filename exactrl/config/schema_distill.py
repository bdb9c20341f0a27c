"""On-policy distillation's section of `exactrl rl` (distill.*): a frozen teacher scores the student's own
samples and a distillation term joins the objective (exactrl/losses/distill_terms.py), the whole of it under
algo.name=on_policy_distill or beside another algorithm's terms."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exactrl.config.schema import Section

# Each distill.loss, what the teacher must give per target token (exactrl/algorithms/distill.py) and what the
# student's forward must give: the sampled token's log-prob, or its whole next-token distribution.
DISTILL_LOSSES = ("k1", "k3", "reverse_kl", "forward_kl_topk", "jsd")


class DistillConfig(Section):
    teacher: str | None = Field(None,
                                description="On-policy distillation: the frozen teacher model (a directory in "
                                            "Hugging Face format, or builtin-sft) that scores the student's own "
                                            "samples, token by token; it must share the student's tokenizer. Its "
                                            "log-probs are taken at rollout.temperature, like the student's. "
                                            "Unset = no distillation term.")
    teacher_engine: Literal["hf", "vllm"] = Field(
        "hf", description="What runs the teacher: 'hf' a frozen model in the trainer's process (or a Ray actor "
                          "group), 'vllm' a vLLM engine process of its own per rank, loading distill.teacher, "
                          "scoring each rollout from vLLM's prompt log-probs (its interpreter, memory and "
                          "timeouts are rollout.vllm.*'s). vLLM gives the log-probs of a few tokens at "
                          "temperature 1: distill.loss=k1, k3 or forward_kl_topk, at rollout.temperature=1, "
                          "without Ray (docs/algorithms/distillation.md).")
    loss: Literal[DISTILL_LOSSES] = Field(
        "k1", description="The per-token divergence to the teacher on the student's sampled tokens: 'k1' the "
                          "reverse KL's sampled-token estimate log p_S(y) - log p_T(y) as a negative advantage, "
                          "trained through the unclipped importance ratio (Thinking Machines' on-policy "
                          "distillation, 2025); 'k3' (r - 1) - log r, r = p_T(y) / p_S(y), differentiated directly "
                          "as GRPO's KL term is (its expected gradient is the forward KL's); 'reverse_kl' KL(p_S || "
                          "p_T) over the whole vocabulary, differentiated directly (GKD's beta = 1); "
                          "'forward_kl_topk' KL(p_T || p_S) over the teacher's distill.topk most likely tokens, "
                          "renormalised; 'jsd' GKD's generalised JSD with distill.beta (Agarwal et al. 2024). "
                          "reverse_kl and jsd keep the teacher's logits of every token of the rollout (tokens x "
                          "vocabulary floats, on the CPU between passes).")
    coef: float = Field(1.0, gt=0, description="Weight of the distillation term in the loss.")
    topk: int = Field(20, ge=1, description="distill.loss=forward_kl_topk: the teacher's most likely tokens kept per "
                                            "position (their log-probs and ids, computed once per rollout).")
    beta: float = Field(0.5, ge=0, le=1,
                        description="distill.loss=jsd: GKD's beta, the mixture M = beta p_T + (1 - beta) p_S; 0 is "
                                    "the forward KL, 1 the reverse KL (TRL's convention).")


def check_teacher_engine(cfg) -> None:
    """What a vLLM teacher cannot give, refused in one line naming the keys (exactrl/workers/vllm_teacher.py)."""
    d = cfg.distill
    if d.teacher is None or d.teacher_engine != "vllm":
        return
    if d.loss in ("reverse_kl", "jsd"):
        raise ValueError(f"distill.loss={d.loss} needs the teacher's logits over the whole vocabulary, which "
                         "distill.teacher_engine=vllm does not give (vLLM returns log-probs of a few tokens): use "
                         "distill.loss=k1, k3 or forward_kl_topk, or distill.teacher_engine=hf")
    if cfg.rollout.temperature != 1.0:
        raise ValueError(f"rollout.temperature={cfg.rollout.temperature:g} with distill.teacher_engine=vllm: vLLM's "
                         "prompt log-probs are at temperature 1 (raw logits), and the teacher's at another "
                         "temperature need every logit: use rollout.temperature=1 or distill.teacher_engine=hf")
    if cfg.ray.enabled:
        raise ValueError("distill.teacher_engine=vllm with ray.enabled=true: the teacher's engine would run outside "
                         "Ray's placement of the run's devices; use distill.teacher_engine=hf (a Ray actor group)")
