"""Where a sampled response ends: its first EOS, or the token that completes one of the run's stop
strings (rollout.stop), matched in the response only. Shared by every generator (the Hugging Face
decode loop, the vLLM client), so a response ends at the same token whichever engine sampled it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import StopStringCriteria


class StopStrings:
    """Which rows' responses so far end with the token that completes one of ``strings``
    (Hugging Face's StopStringCriteria, which also catches a stop string split over tokens or
    overhanging the last one), looking at the response tokens only: a stop string is never
    matched into the prompt."""

    def __init__(self, tokenizer, strings: Iterable[str]):
        self.criteria = StopStringCriteria(tokenizer, list(strings))

    def __call__(self, response: torch.Tensor) -> torch.Tensor:
        return self.criteria(response, None)


def response_ends(tokens: torch.Tensor, eos: int | None, stop: StopStrings | None) -> list[int | None]:
    """Where each row of ``tokens`` [rows, new] ends: its length up to and including its first
    EOS or the token that completes a stop string; None when it reached the length limit."""
    ends = (tokens == eos) if eos is not None else torch.zeros_like(tokens, dtype=torch.bool)
    if stop is not None:
        ends = ends | torch.stack([stop(tokens[:, : t + 1]) for t in range(tokens.shape[1])], 1)
    return [row.index(True) + 1 if True in row else None for row in ends.tolist()]
