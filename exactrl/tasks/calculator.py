"""The built-in multi-turn task: multiplication the tiny model cannot do in its head, with a calculator tool.

A problem is ``a*b=`` for a ``digits``-digit ``a`` and a two-digit ``b``; its answer is the product. The SFT
teacher shows no working: on a fixed fraction of problems, drawn by a seeded die independent of the problem, it
calls the tool, reads the result and answers; on the others it writes the product directly::

    user       347*28=
    assistant  <tool_call>{"name": "calc", "arguments": {"expr": "347*28"}}</tool_call>
    tool       9716
    assistant  #### 9716

    user       347*28=
    assistant  #### 9716

A direct product is right in the data but is what the tiny model cannot learn to compute in one shot, so after
imitation its direct answers are mostly wrong, while copying the tool's always-right result is easy. Whether a
first turn calls the tool is a coin the SFT model inherits from the teacher, not something the problem decides;
greedy decoding picks the teacher's likelier style (direct), so the SFT model calls the tool mostly when
sampling: the room RL has to learn that calling pays, and no RL method reaches high accuracy without the tool.
The final answer keeps the ``#### n`` format, so exactrl.tasks.arithmetic.reward scores the episode's last turn.
RL and held-out rows are chat prompts (``{"prompt": [{"role": "user", ...}], "answer"}``), rendered by the
tokenizer's chat template. Splits are disjoint by construction (a hash of the problem, as in the other tasks).
"""

from __future__ import annotations

import json
import random

from exactrl.tasks.calculator_tools import calc
from exactrl.tasks.multiplication import Problem, _split_of

TOOL_FRACTION = 0.3  # how often the teacher calls the tool
B_RANGE = (10, 99)  # the second operand: two digits, too many partial products to carry in one's head


def generate(split: str, n: int, seed: int, digits: int = 3, eval_percent: int = 10) -> list[Problem]:
    """``n`` distinct problems of ``split`` ("train" or "eval"), deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    capacity = (hi - lo + 1) * (B_RANGE[1] - B_RANGE[0] + 1) * (
        eval_percent if split == "eval" else 100 - eval_percent) // 100
    if n > capacity * 0.9:
        raise ValueError(f"asked for {n} {split} problems; {digits}-digit x 2-digit multiplication has only "
                         f"~{capacity}")
    rng = random.Random(f"{seed}-calc-mul-{split}")
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(rng.randint(lo, hi), rng.randint(*B_RANGE))
        if p not in seen and _split_of(p, eval_percent) == split:
            seen.add(p)
            out.append(p)
    return out


def expression(p: Problem) -> str:
    return p.prompt.removesuffix("=")


def direct_solution(p: Problem) -> str:
    return f"#### {p.answer}"


def tool_call(p: Problem) -> str:
    """The teacher's tool-calling turn (Hermes style, as the tool-calling environment parses it)."""
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": expression(p)}}) + "</tool_call>"


def calls_tool(problems: list[Problem], seed: int, fraction: float = TOOL_FRACTION) -> list[bool]:
    """The teacher's die: which problems it hands to the tool (its own stream, blind to the problem)."""
    rng = random.Random(f"{seed}-calc-tool")
    return [rng.random() < fraction for _ in problems]


def user(p: Problem) -> list[dict]:
    return [{"role": "user", "content": p.prompt}]


def sft_rows(problems: list[Problem], seed: int, fraction: float = TOOL_FRACTION) -> list[dict]:
    """SFT demonstrations as ``{"messages"}`` rows: a tool episode on the die's problems, else the direct answer."""
    rows = []
    for p, tool in zip(problems, calls_tool(problems, seed, fraction)):
        turns = [{"role": "assistant", "content": tool_call(p)}, {"role": "tool", "content": calc(expression(p))},
                 {"role": "assistant", "content": direct_solution(p)}] if tool else [
            {"role": "assistant", "content": direct_solution(p)}]
        rows.append({"messages": user(p) + turns})
    return rows


def mixed_rows(problems: list[Problem], seed: int) -> list[dict]:
    """The SFT problems whose demonstration is one turn, as ``{"prompt", "answer", "demonstration"}`` rows (a
    mixed-policy method's demonstration is one turn; the tool episodes are left out)."""
    return [{"prompt": r["messages"][:1], "answer": p.answer, "demonstration": r["messages"][1]["content"]}
            for p, r in zip(problems, sft_rows(problems, seed)) if len(r["messages"]) == 2]


def pretrain_rows(problems: list[Problem]) -> list[dict]:
    """A base model's pretraining corpus (a study compares one-turn methods and refuses this task; the file exists
    as every task's does): the problems answered directly, as chats."""
    return [{"messages": user(p) + [{"role": "assistant", "content": direct_solution(p)}]} for p in problems]


def rl_rows(problems: list[Problem]) -> list[dict]:
    """RL and held-out prompts as ``{"prompt": messages, "answer"}`` rows."""
    return [{"prompt": user(p), "answer": p.answer} for p in problems]
