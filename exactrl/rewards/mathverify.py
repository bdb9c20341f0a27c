"""Math answers checked with Hugging Face's math-verify: the completion's final answer (boxed
LaTeX, $...$, or a plain expression) is parsed and compared symbolically with the reference
answer, so 1/2, 0.5 and \\frac{1}{2} agree. Use as ``reward.fn=exactrl.rewards.mathverify:reward``
with JSONL rows ``{"prompt": ..., "answer": ...}``.

math-verify bounds each parse and comparison with ``signal.alarm``, which works only in a
process's main thread: exactrl calls rewards there (exactrl/rewards/worker.py). Called from
any other thread (a threaded server, a user's pool), the per-sample limits are switched off
rather than failing every call, and the caller's own timeout is the only bound."""

from __future__ import annotations

import threading

from math_verify import parse, verify

# Seconds per parse and per comparison: a pathological expression scores 0 instead of holding
# the whole batch up to reward.timeout (math-verify's own defaults, stated here on purpose).
PARSE_SECONDS, VERIFY_SECONDS = 5, 5


def reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the completion's answer equals the reference answer, else 0.0."""
    main = threading.current_thread() is threading.main_thread()
    parse_s, verify_s = (PARSE_SECONDS, VERIFY_SECONDS) if main else (None, None)
    out = []
    for completion, answer in zip(completions, answers):
        if answer is None:
            raise ValueError("exactrl.rewards.mathverify:reward needs an 'answer' in every prompt row")
        gold, got = parse(str(answer), parsing_timeout=parse_s), parse(completion, parsing_timeout=parse_s)
        out.append(1.0 if verify(gold, got, timeout_seconds=verify_s) else 0.0)
    return out
