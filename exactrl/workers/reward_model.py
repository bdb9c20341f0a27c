"""A reward model: the critic's value model (the policy's architecture with a scalar head per position,
models/loading.py load_value_model) trained on preference pairs by `exactrl rm`.

**Where it scores.** A sequence's reward is the head's output at the **last real token of its answer**: the
answer's last loss token, its EOS (or the chat template's end of turn), found from the loss mask
(losses/pairs.py last_token_scores). Not at the first pad token, nor at the last non-pad one: with a tokenizer
whose pad equals its EOS (SmolLM2's, Qwen's) the first "pad" may be an end of turn inside the prompt and the
last non-pad token is the one before the answer's EOS (what AutoModelForSequenceClassification's pad-id search
reads there). The per-token field "scores" holds at target t the head's output at target t's own token (the
token after the one that predicts it), so the answer's last target carries the answer's last token's score,
packed or padded alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactrl.data.batch import Sample, collate
from exactrl.distributed.engine import build_engine
from exactrl.losses.pairs import last_token_scores
from exactrl.losses.token_losses import at_least_fp32
from exactrl.models.loading import load_value_model
from exactrl.workers.load import load_model
from exactrl.workers.worker import Worker


def target_scores(output_logits: torch.Tensor) -> torch.Tensor:
    """[B, L, 1] head outputs -> [B, L-1]: at target t, the head's output at target t's token (position t + 1)."""
    return output_logits[:, 1:, 0].to(at_least_fp32(output_logits.dtype))


class RewardModel(Worker):
    @classmethod
    def _build(cls, cfg, role, path, *, run_dir: Path, phase: str, longest: int, pad_id: int, total_steps: int,
               checkpoint: str | None, policy) -> RewardModel:
        """From the checkpoint being resumed (its weights are the reward model's), else ``path``: a causal LM
        (a new head, seeded from train.seed) or a saved reward model; packing self-checked like a policy."""

        def loader(p, trainable, attn, dropout, trust_remote_code):  # the head's dropout is off: a deterministic score
            return load_value_model(p, init_seed=cfg.train.seed, attn=attn, trust_remote_code=trust_remote_code)

        model = load_model(cfg, path, run_dir, phase, role, longest, loader=loader, checkpoint=checkpoint)
        return cls(role, model, build_engine(model, cfg, total_steps), pad_id=pad_id, packed=cfg.train.padding_free)

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if name != "scores":
            raise ValueError(f"the reward model computes scores, not '{name}'")
        return target_scores(logits)

    def score(self, samples: list[Sample], layout: list[list[list[int]]]) -> torch.Tensor:
        """Each sample's reward [N] (no gradient), at its answer's last real token; ``layout`` as Worker.forward."""
        per_target = self.forward(samples, "scores", layout)
        return torch.stack([last_token_scores(v[None], collate([s], self.pad_id)["loss_mask"])[0]
                            for s, v in zip(samples, per_target)])
