"""The generator interface: what the RL loop asks of a rollout engine.

    generate(prompt_ids, params) -> [Generation]   tokens, text and sampling log-probs
    load_weights(named_tensors) -> version          the policy's weights, verified on arrival
    weights_version                                 the version the next generation samples with

The Hugging Face decode loop (exactrl/rollout/hf.py) is the first implementation; a vLLM
engine or a Ray actor holding one is another, with no change to the loop. Every Generation
carries the weights version it was sampled with, so a sample can always say which policy
produced it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # responses per prompt
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()  # a response ends with the token that completes one of these (kept in it)
    max_new_tokens: int = 48


class WeightSyncError(RuntimeError):
    """A generator's weights differ from the trainer's after a load."""


class Generator(Protocol):
    weights_version: int

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list: ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int: ...
