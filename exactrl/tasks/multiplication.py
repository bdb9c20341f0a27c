"""The second built-in task (``task.name=multiplication``): a ``digits``-digit number times a
one-digit number (2-9), worked digit by digit, with a teacher that is wrong in two controlled ways.

A worked solution multiplies from the units up, one digit per step, the carry added and every
step two digits wide, then the answer ``digits + 1`` wide in the same ``#### <n>`` format the
addition task uses (so its verifier, exactrl.tasks.arithmetic:reward, scores both):
``4736*7=`` -> ``6*7+0=42 3*7+4=25 7*7+2=51 4*7+5=33 #### 33152``.

The SFT teacher (``sft_rows``) has the addition task's habit and one more flaw:

* habit: when the first operand's last digit is below ``10 * direct_fraction`` it skips the
  working with probability ``skip_prob`` and writes an answer alone, which a small model cannot
  compute in one shot;
* slips: in a step whose incoming carry is ``SLIP_CARRY`` or more it forgets the carry with
  probability ``slip_prob``, and carries on from its own wrong step, so the demonstration's
  answer is wrong. Above one half, the imitated (greedy) model forgets such carries too.

Both flaws are per problem and drawn from one seeded generator; the demonstrations still contain
the right behaviour often enough for sampling to find it, which is what RL with the verifier's
reward can select, and what a method imitating the demonstrations during RL is also shown wrong.
Splits are disjoint by construction, as in the addition task (a hash of the problem).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

SLIP_CARRY = 4  # the teacher may forget a carry this large or larger: about a third of the steps


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b)


def worked_solution(p: Problem, forget: frozenset[int] = frozenset()) -> str:
    """Digit by digit from the units, e.g. ``6*7+0=42 3*7+4=25 7*7+2=51 4*7+5=33 #### 33152``; in the
    steps of ``forget`` the incoming carry is written and added as 0 (a teacher's slip)."""
    steps, carry, digits = [], 0, [int(d) for d in str(p.a)[::-1]]
    for i, d in enumerate(digits):
        carry = 0 if i in forget else carry
        s = d * p.b + carry
        steps.append(f"{d}*{p.b}+{carry}={s:02d}")
        carry = s // 10
    value = int(str(carry) + "".join(step[-1] for step in reversed(steps)))  # what the steps computed
    return " ".join(steps) + f" #### {str(value).zfill(len(digits) + 1)}"


def carries(p: Problem) -> list[int]:
    """The incoming carry of each step of the correct working."""
    out, carry = [], 0
    for d in (int(x) for x in str(p.a)[::-1]):
        out.append(carry)
        carry = (d * p.b + carry) // 10
    return out


def direct_solution(p: Problem) -> str:
    return f"#### {p.answer.zfill(len(str(p.a)) + 1)}"


def _split_of(p: Problem, eval_percent: int) -> str:
    h = int(hashlib.sha256(p.prompt.encode()).hexdigest()[:8], 16) % 100
    return "eval" if h < eval_percent else "train"


def generate(split: str, n: int, seed: int, digits: int = 4, eval_percent: int = 10) -> list[Problem]:
    """``n`` distinct problems of ``split`` ("train" or "eval"), deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    capacity = (hi - lo + 1) * 8 * (eval_percent if split == "eval" else 100 - eval_percent) // 100
    if n > capacity * 0.9:
        raise ValueError(f"asked for {n} {split} problems; {digits}-digit x 1-digit multiplication has only "
                         f"~{capacity}")
    rng = random.Random(f"{seed}-mul-{split}")
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(rng.randint(lo, hi), rng.randint(2, 9))
        if p not in seen and _split_of(p, eval_percent) == split:
            seen.add(p)
            out.append(p)
    return out


def demonstrations(problems: list[Problem], direct_fraction: float, skip_prob: float, slip_prob: float,
                   seed: int) -> list[str]:
    """The teacher's completion for each problem (habit and slips as the module says)."""
    rng = random.Random(f"{seed}-mul-teacher")
    out = []
    for p in problems:
        skip = p.a % 10 < round(10 * direct_fraction) and rng.random() < skip_prob
        forget = frozenset(i for i, c in enumerate(carries(p)) if c >= SLIP_CARRY and rng.random() < slip_prob)
        out.append(direct_solution(p) if skip else worked_solution(p, forget))
    return out
