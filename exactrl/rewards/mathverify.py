"""Math answers checked with Hugging Face's math-verify: the completion's final answer (boxed
LaTeX, $...$, or a plain expression) is parsed and compared symbolically with the reference
answer, so 1/2, 0.5 and \\frac{1}{2} agree. Use as ``reward.fn=exactrl.rewards.mathverify:reward``
with JSONL rows ``{"prompt": ..., "answer": ...}``."""

from __future__ import annotations

from math_verify import parse, verify


def reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the completion's answer equals the reference answer, else 0.0."""
    out = []
    for completion, answer in zip(completions, answers):
        if answer is None:
            raise ValueError("exactrl.rewards.mathverify:reward needs an 'answer' in every prompt row")
        out.append(1.0 if verify(parse(str(answer)), parse(completion)) else 0.0)
    return out
