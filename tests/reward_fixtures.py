"""Misbehaving and well-behaved reward functions for tests/test_reward_isolation.py and the
RL tests. Kept apart from the test modules so the reward process imports only this (no torch)."""

from __future__ import annotations

import os
import signal
import sys
import time


def hangs(prompts, completions, answers):
    time.sleep(3600)


def hangs_after_touching(prompts, completions, answers):
    """Hangs once it has created the file its first prompt names (so a test knows it is busy)."""
    open(prompts[0], "w").close()
    time.sleep(3600)


def hangs_on_x(prompts, completions, answers):
    if any("x" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def exits(prompts, completions, answers):
    sys.exit(0)


def os_exits(prompts, completions, answers):
    os._exit(0)


def raises_on_x(prompts, completions, answers):
    if any("x" in c for c in completions):
        raise ValueError("cannot score an x")
    return [float(len(c)) for c in completions]


def batch_only_bug(prompts, completions, answers):
    if len(completions) > 1:
        raise RuntimeError("batched call broken")
    return [0.5]


def uses_alarm(prompts, completions, answers):
    """signal.alarm works only in a main thread: what math-verify needs."""
    signal.signal(signal.SIGALRM, lambda *a: None)
    signal.alarm(10)
    signal.alarm(0)
    return [1.0] * len(completions)


def length(prompts, completions, answers):
    return [len(c) / 10 for c in completions]


length.needs_answer = False


def varied(prompts, completions, answers):
    """Differs within a group even for an untrained model; needs no answer."""
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


varied.needs_answer = False


def raises_key_error(prompts, completions, answers):
    raise KeyError("no field 'solution'")


def too_few(prompts, completions, answers):
    return [1.0]


def nan(prompts, completions, answers):
    return [float("nan")] * len(completions)


def length_of_text(prompts, completions, answers):
    return [float(len(c)) for c in completions]


def one(prompts, completions, answers):
    """Full reward for anything: evaluation with it scores 100% where the arithmetic checker scores 0."""
    return [1.0] * len(completions)


def raises_on_bad_prompt(prompts, completions, answers):
    if any("bad" in p for p in prompts):
        raise ValueError("this prompt is bad")
    return [0.0] * len(completions)


def raises_then_hangs(prompts, completions, answers):
    """Raises on any batch; alone, hangs on 'h' and scores the rest."""
    if len(completions) > 1:
        raise ValueError("batch")
    if completions[0] == "h":
        time.sleep(3600)
    return [1.0]


def parity(prompts, completions, answers):
    """1 for about half of the samples (the parity of the character codes of prompt and answer):
    an accuracy that moves with any generated character, for comparing two evaluations."""
    return [float(sum(map(ord, p + c)) % 2 == 0) for p, c in zip(prompts, completions)]


parity.needs_answer = False


def prompt_parity(prompts, completions, answers):
    """1 for every response to a prompt whose character codes sum to an even number, else 0: each
    question's group is all right or all wrong, so what a mixed-policy method does with it is known."""
    return [float(sum(map(ord, p)) % 2 == 0) for p in prompts]


prompt_parity.needs_answer = False
