"""The typed batch: sequences with declared per-sequence and per-token fields.

A batch is a list of ``Sample`` rows. Per-token fields are declared once below (``per_token``),
each a tensor of length len(prompt + response) - 1 aligned with the next-token targets, and
``collate`` derives its keys from that declaration. ``slots`` makes the declaration binding:
a field nobody declared cannot be set. ``source`` says where a sequence comes from, so loops
that mix data (on-policy rollouts with demonstrations, preference pairs) can tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from exactrl.data.batching import pad_right

Source = Literal["on_policy", "demonstration", "chosen", "rejected"]


def per_token(doc: str):
    """A declared per-token field (None until a pass computes it)."""
    return field(default=None, metadata={"per_token": True, "doc": doc})


@dataclass(slots=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float = 0.0  # the weighted sum of the rewards, with any overlong shaping
    finished: bool = True  # the model stopped by itself within rollout.max_new_tokens
    parts: dict[str, float] = field(default_factory=dict)  # each reward.fn's own value
    penalty: float = 0.0  # overlong shaping included in ``reward``
    source: Source = "on_policy"
    weights_version: int | None = None  # the generator's weights version that sampled it (on-policy)
    advantages: torch.Tensor | None = per_token("zero on prompt targets")
    old_logprobs: torch.Tensor | None = per_token("the policy's before the rollout's first update, fixed for the rollout")
    gen_logprobs: torch.Tensor | None = per_token("the generator's at sampling time, zero on prompt targets")
    ref_logprobs: torch.Tensor | None = per_token("the frozen reference's")
    old_values: torch.Tensor | None = per_token("the critic's before the rollout's first update (ppo)")
    returns: torch.Tensor | None = per_token("the critic's targets (ppo)")

    @property
    def ids(self) -> list[int]:
        """Prompt and response, the sequence every forward sees."""
        return self.prompt_ids + self.response_ids

    @property
    def num_targets(self) -> int:
        """Length of every per-token field: one per next-token target."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


TOKEN_FIELDS = tuple(f.name for f in fields(Sample) if f.metadata.get("per_token"))


def collate(samples: list[Sample], pad_id: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Prompt+response sequences, right-padded. ``loss_mask`` [B, L-1] marks response targets;
    every declared per-token field set on all samples is padded to the same width. On ``device``
    (the model's), else the CPU."""
    seqs = [s.ids for s in samples]
    ids = pad_right(seqs, pad_id)
    attn = pad_right([[1] * len(s) for s in seqs], 0)
    mask = pad_right([[0] * len(s.prompt_ids) + [1] * len(s.response_ids) for s in samples], 0)[:, 1:]
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    width = ids.size(1) - 1
    for key in TOKEN_FIELDS:
        values = [getattr(s, key) for s in samples]
        if all(v is not None for v in values):
            out[key] = torch.stack([torch.nn.functional.pad(v, (0, width - v.numel())) for v in values])
    return out if device is None else {k: v.to(device) for k, v in out.items()}
