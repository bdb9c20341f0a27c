"""The built-in verifiable task: multi-digit addition with optional worked steps.

A problem is ``a+b=`` for two ``digits``-digit numbers. A solution is written in one of two
styles, both ending in the fixed answer format ``#### <sum>`` that the verifier parses:

* worked: column addition from the units up, one column per step, carry written out, every
  column sum two digits wide so each step has the same shape:
  ``347+285=`` -> ``7+5+0=12 4+8+1=13 3+2+1=06 #### 0632``
* direct: the answer alone: ``#### 0632``

Answers are written ``digits + 1`` wide (zero-padded), so every character of a worked
solution sits at a fixed offset from the digits it is computed from; the verifier compares
integers, so ``0632`` and ``632`` are both right.

The SFT demonstrations come from a teacher with a habit: when the first operand's last
digit is below ``10 * direct_fraction`` it usually (with probability ``skip_prob``) skips
the working (a habit, not something the task needs). A small model executes the worked
style reliably but cannot add multi-digit numbers in one shot, so after imitation its
greedy answer to those problems is direct and mostly wrong, while sampling still works
them out now and then. The verifier reward lets RL discover that working pays on every problem. This is the
mechanism by which SFT-then-RL beats SFT alone (RL selects among behaviours the SFT data
contains), and it leaves RL honest room to improve on held-out problems. Splits are disjoint by
construction: a problem's split is a hash of the problem itself, so no eval problem is ever trained on.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

ANSWER_RE = re.compile(r"####\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def worked_solution(p: Problem) -> str:
    """Column addition, units first, e.g. ``7+5+0=12 4+8+1=13 3+2+1=06 #### 0632``."""
    da, db = str(p.a)[::-1], str(p.b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return " ".join(steps) + f" #### {padded_answer(p)}"


def forgetful_solution(p: Problem) -> str:
    """The worked style with every carry forgotten (written and added as 0), the answer what those
    steps computed: ``729+485=`` -> ``9+5+0=14 2+8+0=10 7+4+0=11 #### 1104``. Right exactly when no
    column carries. The pretraining corpus of a study's base model (exactrl/pipelines/study.py): a
    model that knows the format and the columns but has never seen a carry, which it cannot find by
    sampling and the demonstrations show."""
    n = max(len(str(p.a)), len(str(p.b)))
    columns = list(zip(str(p.a)[::-1].ljust(n, "0"), str(p.b)[::-1].ljust(n, "0")))
    sums = [int(x) + int(y) for x, y in columns]
    steps = [f"{x}+{y}+0={s:02d}" for (x, y), s in zip(columns, sums)]
    value = str(sums[-1] // 10) + "".join(str(s % 10) for s in reversed(sums))
    return " ".join(steps) + f" #### {value.zfill(len(steps) + 1)}"


def padded_answer(p: Problem) -> str:
    """The sum, zero-padded to one digit more than the longer operand."""
    return p.answer.zfill(max(len(str(p.a)), len(str(p.b))) + 1)


def direct_solution(p: Problem) -> str:
    return f"#### {padded_answer(p)}"


def extract_answer(completion: str) -> str | None:
    """The integer after the last ``####``, or None when the format is not respected."""
    m = ANSWER_RE.search(completion.strip())
    return m.group(1) if m else None


def is_correct(completion: str, answer: str) -> bool:
    got = extract_answer(completion)
    return got is not None and int(got) == int(answer)


def reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Verifier reward: 1.0 for the right final answer in the ``#### n`` format, else 0.0."""
    return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answers)]


def _split_of(p: Problem, eval_percent: int) -> str:
    h = int(hashlib.sha256(p.prompt.encode()).hexdigest()[:8], 16) % 100
    return "eval" if h < eval_percent else "train"


def generate(split: str, n: int, seed: int, digits: int = 3, eval_percent: int = 10) -> list[Problem]:
    """``n`` distinct problems of ``split`` ("train" or "eval"), deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    capacity = (hi - lo + 1) ** 2 * (eval_percent if split == "eval" else 100 - eval_percent) // 100
    if n > capacity * 0.9:
        raise ValueError(f"asked for {n} {split} problems; {digits}-digit addition has only ~{capacity}")
    rng = random.Random(f"{seed}-{split}")
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(rng.randint(lo, hi), rng.randint(lo, hi))
        if p not in seen and _split_of(p, eval_percent) == split:
            seen.add(p)
            out.append(p)
    return out


def in_habit(p: Problem, direct_fraction: float) -> bool:
    """Problems on which the demonstrator tends to skip the working: a's last digit < 10 * direct_fraction."""
    return p.a % 10 < round(10 * direct_fraction)


def sft_rows(problems: list[Problem], direct_fraction: float, skip_prob: float, seed: int) -> list[dict]:
    """SFT demonstrations as ``{"prompt", "completion"}`` rows, in the teacher's style."""
    rng = random.Random(f"{seed}-teacher")
    rows = []
    for p in problems:
        skip = in_habit(p, direct_fraction) and rng.random() < skip_prob
        rows.append({"prompt": p.prompt, "completion": direct_solution(p) if skip else worked_solution(p)})
    return rows


def mixed_rows(problems: list[Problem], direct_fraction: float, skip_prob: float, seed: int) -> list[dict]:
    """The SFT problems as ``{"prompt", "answer", "demonstration"}`` rows, the demonstration being
    exactly the SFT row's completion: mixed-policy methods see the data SFT sees."""
    return [{"prompt": r["prompt"], "answer": p.answer, "demonstration": r["completion"]}
            for p, r in zip(problems, sft_rows(problems, direct_fraction, skip_prob, seed))]


def pretrain_rows(problems: list[Problem]) -> list[dict]:
    """A base model's pretraining corpus: ``{"prompt", "completion"}`` rows in the forgetful style."""
    return [{"prompt": p.prompt, "completion": forgetful_solution(p)} for p in problems]


def rl_rows(problems: list[Problem]) -> list[dict]:
    """RL prompts as ``{"prompt", "answer"}`` rows."""
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]
