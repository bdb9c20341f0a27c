"""Held-out accuracy: generate for every eval prompt, score with the verifier, Wilson 95% CI."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from exactrl.data.encode import Prompt
from exactrl.rewards import DEFAULT_TIMEOUT, Reward, score
from exactrl.rollout.hf import HFEngine


@dataclass(frozen=True)
class Accuracy:
    value: float
    ci95: tuple[float, float]
    correct: int
    n: int
    seconds: float
    generated_tokens: int
    reward_failures: int = 0  # answers the reward failed on, scored with reward.fallback instead

    def as_dict(self) -> dict:
        return {"value": self.value, "ci95": list(self.ci95), "correct": self.correct, "n": self.n}

    def __str__(self) -> str:
        return f"{100 * self.value:5.1f}% [{100 * self.ci95[0]:.1f}, {100 * self.ci95[1]:.1f}]"


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well-behaved near 0 and 1)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At k = 0 or k = n the bound is exactly 0 or 1; rounding must not push it past p.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return (low, high)


def evaluate_accuracy(model, tokenizer, prompts: list[Prompt], reward: Reward, *, batch_size: int, max_new_tokens: int,
                      greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, timeout: float = DEFAULT_TIMEOUT,
                      fallback: float | None = None) -> Accuracy:
    """Share of prompts whose (greedy or sampled) answer gets full reward (>= 1) from ``reward``,
    scored ``batch_size`` answers per call, each call under the run's reward.timeout and reward.fallback."""
    t0 = time.perf_counter()
    gens = HFEngine(model, tokenizer, batch_size).generate(
        [p.input_ids for p in prompts], greedy=greedy, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens
    )
    rewards, failures = [], []
    for i in range(0, len(prompts), batch_size):
        chunk, answered = prompts[i : i + batch_size], gens[i : i + batch_size]
        rewards += score(reward, [p.text for p in chunk], [g.text for g in answered], [p.answer for p in chunk],
                         [p.source for p in chunk], timeout, fallback, failures)
    k = sum(r >= 1.0 for r in rewards)
    return Accuracy(k / len(prompts), wilson_interval(k, len(prompts)), k, len(prompts), time.perf_counter() - t0,
                    sum(len(g.response_ids) for g in gens), len(failures))
