"""A distillation teacher: a frozen model of its own (never the policy's, LoRA or not), run like the
reference (the run's autocast and log-prob chunks, the rollout's temperature), whose per-token fields of the
student's samples feed a distillation term (exactrl/losses/distill_terms.py). Besides the sampled token's
log-prob ("logprobs") and its logits ("logits"), it gives its ``k`` largest log-probs per position and their
ids ("topk_logprobs", "topk_ids"), what a top-k forward KL needs without keeping the whole vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch

from exactrl.device import process_device
from exactrl.dtypes import autocast_for
from exactrl.losses.token_losses import at_least_fp32
from exactrl.workers.load import load_model
from exactrl.workers.worker import Worker


class Teacher(Worker):
    topk: int = 0

    @classmethod
    def _build(cls, cfg, role, path, *, run_dir: Path, phase: str, longest: int, pad_id: int, total_steps: int,
               checkpoint: str | None, policy) -> Teacher:
        device, dtype = process_device(), cfg.model.dtype
        model = load_model(cfg, path, run_dir, phase, role, longest, trainable=False)
        teacher = cls(role, model, pad_id=pad_id, packed=cfg.train.padding_free, temperature=cfg.rollout.temperature,
                      logprob_chunk=cfg.train.logprob_chunk_size, autocast=lambda: autocast_for(dtype, device))
        teacher.topk = cfg.distill.topk
        return teacher

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if name == "logits":  # kept for a divergence over the whole vocabulary, in fp32 at least
            return logits[:, :-1].to(at_least_fp32(logits.dtype))
        if name in ("topk_logprobs", "topk_ids"):
            scores = logits[:, :-1].to(at_least_fp32(logits.dtype)) / self.temperature
            top, ids = scores.log_softmax(-1).topk(min(self.topk, scores.size(-1)), dim=-1)
            return top if name == "topk_logprobs" else ids
        return super().token_field(name, logits, input_ids)
