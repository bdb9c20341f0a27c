"""Preference, unpaired and step-labelled sets from the built-in addition task (exactrl/tasks/arithmetic.py),
so reward models, the DPO family, KTO and a process reward model train and are tested offline.

* pairs ``{"prompt", "chosen", "rejected", "answer", "rejected_kind"}``: chosen is the worked, correct
  solution; rejected is wrong, one of three kinds, by a die per problem: ``direct``, a direct answer
  whose number is off in one column (the built-in SFT model's greedy failure: it skips the working on the
  teacher's habit problems and misses); ``working``, the worked style with one slip in a column (a column
  sum written wrong, a carry dropped or invented, a digit miscopied) and every later column and the
  answer computed from what was written, so the slip alone makes it wrong; or ``answer``, every column
  right and one digit of the answer line miscopied from them (the most frequent error of the SFT model's
  sampled worked answers). Two of three pairs differ only in correctness, not in style;
* unpaired ``{"prompt", "completion", "label", "answer"}``: one side of such a pair per problem, by a
  coin: the correct worked solution (true) or the wrong one (false);
* step-labelled ``{"prompt", "completions", "labels", "answer"}``: a worked solution (by a die, the
  correct one, one with a column slip or one with a miscopied answer) cut into its column steps,
  ``####`` and the answer (the answer line holds the separator too); each column step is labelled by
  itself (its digits are the column's, its carry the one the step before it wrote, its sum right),
  ``####`` right, the answer by the task's verifier. Joined with STEP_SEPARATOR the steps are the
  solution's text, as the policy writes it.

The training sets use the problems of the built-in RL split, the held-out sets the built-in eval
split's (disjoint by the task's hash of each problem), so no held-out problem is ever trained on.
Everything is a function of the BuiltinSpec: two builds write the same bytes.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from exactrl.tasks import arithmetic
from exactrl.tasks.arithmetic import Problem

STEP_SEPARATOR = " "  # what separates a worked solution's steps: a PRM scores the policy's own text at it
SETS = ("pairs", "unpaired", "steps")
KINDS = tuple(f"{s}_{split}" for s in SETS for split in ("train", "eval"))  # resolve()'s names of the files
VERSION = 2  # in the directory name: a change to what is generated builds afresh, beside older caches
STEP_RE = re.compile(r"(\d)\+(\d)\+(\d)=(\d\d)")


@dataclass(frozen=True)
class Column:
    """One step of column addition as written: ``x+y+carry=total``."""
    x: int
    y: int
    carry: int
    total: int

    def __str__(self) -> str:
        return f"{self.x}+{self.y}+{self.carry}={self.total:02d}"


def digits(p: Problem) -> list[tuple[int, int]]:
    """The problem's columns, units first: the digits of a and b (0 past the shorter one)."""
    n = max(len(str(p.a)), len(str(p.b)))
    return [(int(x), int(y)) for x, y in zip(str(p.a)[::-1].ljust(n, "0"), str(p.b)[::-1].ljust(n, "0"))]


def _work(pairs: list[tuple[int, int]], carry: int = 0) -> list[Column]:
    """Columns computed right from ``carry``: each total the sum, each carry the total's tens."""
    out = []
    for x, y in pairs:
        out.append(Column(x, y, carry, x + y + carry))
        carry = out[-1].total // 10
    return out


def answer_of(columns: list[Column]) -> str:
    """The answer the written columns compute: the last carry, then each total's units, highest first."""
    return str(columns[-1].total // 10) + "".join(str(c.total % 10) for c in reversed(columns))


def solution_steps(columns: list[Column], answer: str | None = None) -> list[str]:
    """The steps of a worked solution: each column, then the answer line cut at STEP_SEPARATOR as a run cuts
    the policy's text (``####`` and the number: a PRM in `exactrl rl` scores every separator of a sampled
    response, the one inside the answer line too, so it must have been trained there). The number is the
    one the columns compute unless ``answer`` is given."""
    return [str(c) for c in columns] + ["####", answer_of(columns) if answer is None else answer]


def slipped(p: Problem, rng: random.Random) -> tuple[list[Column], str]:
    """A worked solution with one slip at a random column, and what the slip was; the columns after
    it are computed right from what was written, so the answer is off by the slip alone."""
    pairs = digits(p)
    k = rng.randrange(len(pairs))
    how = rng.choice(("sum", "carry", "digit") if k else ("sum", "digit"))  # the units column has no carry in
    columns = _work(pairs[:k])
    carry = columns[-1].total // 10 if columns else 0
    x, y = pairs[k]
    if how == "sum":
        total = rng.choice([t for t in range(20) if t != x + y + carry])
        slip = Column(x, y, carry, total)
    elif how == "carry":
        slip = Column(x, y, 1 - carry, x + y + 1 - carry)
    else:
        x = (x + rng.choice((1, 9))) % 10
        slip = Column(x, y, carry, x + y + carry)
    return columns + [slip] + _work(pairs[k + 1:], slip.total // 10), how


def miscopied(p: Problem, rng: random.Random) -> list[str]:
    """The steps of a worked solution whose columns are all right and whose answer line has one digit
    miscopied from them."""
    columns = _work(digits(p))
    answer = list(answer_of(columns))
    k = rng.randrange(len(answer))
    answer[k] = str((int(answer[k]) + rng.randrange(1, 10)) % 10)
    return solution_steps(columns, "".join(answer))


def wrong_steps(p: Problem, kind: str, rng: random.Random) -> list[str]:
    """A wrong worked solution's steps: a column slip (``working``) or a miscopied answer (``answer``)."""
    return solution_steps(slipped(p, rng)[0]) if kind == "working" else miscopied(p, rng)


def step_labels(p: Problem, steps: list[str]) -> list[bool]:
    """Each step judged by itself: a column step must read the column's digits, the carry the step
    before it wrote (0 first) and their sum; the ``####`` step is the format's, right as written; the number
    after it must be the right sum (the verifier)."""
    labels, carry, pairs = [], 0, digits(p)
    for i, step in enumerate(steps):
        if step == "####" or (i and steps[i - 1] == "####"):
            labels.append(step == "####" or arithmetic.is_correct(f"#### {step}", p.answer))
            continue
        m = STEP_RE.fullmatch(step)
        if m is None or i >= len(pairs):
            labels.append(False)
            continue
        x, y, c, total = (int(g) for g in m.groups())
        labels.append((x, y) == pairs[i] and c == carry and total == x + y + c)
        carry = total // 10
    return labels


def _rows(problems: list[Problem], rng: random.Random) -> dict[str, list[dict]]:
    """The three sets' rows for ``problems``, from one stream of coins."""
    out = {s: [] for s in SETS}
    for p in problems:
        chosen = arithmetic.worked_solution(p)
        kind = rng.choice(("direct", "working", "answer"))
        if kind == "direct":
            rejected = f"#### {answer_of(slipped(p, rng)[0])}"
        else:
            rejected = STEP_SEPARATOR.join(wrong_steps(p, kind, rng))
        if not arithmetic.is_correct(chosen, p.answer) or arithmetic.is_correct(rejected, p.answer):
            raise AssertionError(f"{p.prompt} {chosen!r} vs {rejected!r}: the chosen must be right, the rejected wrong")
        out["pairs"].append({"prompt": p.prompt, "chosen": chosen, "rejected": rejected, "answer": p.answer,
                             "rejected_kind": kind})
        good = rng.random() < 0.5
        out["unpaired"].append({"prompt": p.prompt, "completion": chosen if good else rejected, "label": good,
                                "answer": p.answer})
        how = rng.choice(("right", "working", "answer"))
        steps = solution_steps(_work(digits(p))) if how == "right" else wrong_steps(p, how, rng)
        out["steps"].append({"prompt": p.prompt, "completions": steps, "labels": step_labels(p, steps),
                             "answer": p.answer})
    return out


@dataclass(frozen=True)
class PreferencePaths:
    root: Path
    pairs_train: Path
    pairs_eval: Path
    unpaired_train: Path
    unpaired_eval: Path
    steps_train: Path
    steps_eval: Path


def splits(seed: int, digits: int, n_sft: int, n_rl: int, n_eval: int) -> dict[str, list[Problem]]:
    """The problems of each split: the built-in RL split's for training (the problems after the
    built-in SFT set's n_sft), the built-in eval split's held out."""
    train = arithmetic.generate("train", n_sft + n_rl, seed, digits)[n_sft:]
    return {"train": train, "eval": arithmetic.generate("eval", n_eval, seed, digits)}


def ensure_preference(root: Path, seed: int, digits: int, n_sft: int, n_rl: int, n_eval: int) -> PreferencePaths:
    """Build (once) the sets under ``root`` (the built-in task's cache directory: builtin.ensure_builtin_preference)
    and return their paths."""
    home = Path(root) / f"preference-v{VERSION}"
    paths = PreferencePaths(home, *(home / f"{kind}.jsonl" for kind in KINDS))
    if (home / "DONE").exists():
        return paths
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(home / ".lock"):  # several ranks or runs may ask at once: one builds, the others wait
        if not (home / "DONE").exists():
            for split, problems in splits(seed, digits, n_sft, n_rl, n_eval).items():
                rows = _rows(problems, random.Random(f"{seed}-preference-{split}"))
                for s in SETS:
                    _write_jsonl(getattr(paths, f"{s}_{split}"), rows[s])
            (home / "DONE").write_text("")
    return paths


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
