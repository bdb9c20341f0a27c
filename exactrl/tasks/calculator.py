"""The built-in multi-turn task: the addition task with a calculator tool the model may call.

The problems, splits and one-turn solutions are the addition task's (exactrl/tasks/arithmetic.py). The SFT
teacher is the addition teacher (worked solutions, and direct answers out of habit) except that on a fixed
fraction of problems, drawn by a seeded die independent of the problem, it calls the tool instead of answering,
reads the result, and answers directly::

    user       347+285=
    assistant  <tool_call>{"name": "calc", "arguments": {"expr": "347+285"}}</tool_call>
    tool       632
    assistant  #### 0632

The tool (exactrl/tasks/calculator_tools.py: calc) is always right, so an episode that calls it and copies the
result wins; whether a first turn calls it is a coin the SFT model inherits from the teacher, not something the
problem decides. Greedy decoding picks the teacher's likelier one-turn style, so the SFT model calls the tool
mostly when sampling: the room RL has to learn that calling pays. The final answer keeps the ``#### n`` format,
so exactrl.tasks.arithmetic.reward scores the episode's last turn. RL and held-out rows are chat prompts
(``{"prompt": [{"role": "user", ...}], "answer"}``), rendered by the tokenizer's chat template.
"""

from __future__ import annotations

import json
import random

from exactrl.tasks import arithmetic
from exactrl.tasks.arithmetic import Problem
from exactrl.tasks.calculator_tools import calc

TOOL_FRACTION = 0.3  # how often the teacher calls the tool


def tool_call(p: Problem) -> str:
    """The teacher's tool-calling turn (Hermes style, as the tool-calling environment parses it)."""
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": p.prompt[:-1]}}) + "</tool_call>"


def calls_tool(problems: list[Problem], seed: int, fraction: float = TOOL_FRACTION) -> list[bool]:
    """The teacher's die: which problems it hands to the tool (its own stream, so the one-turn rows are the
    addition teacher's, draw for draw)."""
    rng = random.Random(f"{seed}-calc-tool")
    return [rng.random() < fraction for _ in problems]


def user(p: Problem) -> list[dict]:
    return [{"role": "user", "content": p.prompt}]


def sft_rows(problems: list[Problem], direct_fraction: float, skip_prob: float, seed: int,
             fraction: float = TOOL_FRACTION) -> list[dict]:
    """SFT demonstrations as ``{"messages"}`` rows: a tool episode on the die's problems, else the addition
    teacher's one turn."""
    one_turn = arithmetic.sft_rows(problems, direct_fraction, skip_prob, seed)
    rows = []
    for p, r, tool in zip(problems, one_turn, calls_tool(problems, seed, fraction)):
        turns = [{"role": "assistant", "content": tool_call(p)}, {"role": "tool", "content": calc(p.prompt[:-1])},
                 {"role": "assistant", "content": arithmetic.direct_solution(p)}] if tool else [
            {"role": "assistant", "content": r["completion"]}]
        rows.append({"messages": user(p) + turns})
    return rows


def mixed_rows(problems: list[Problem], direct_fraction: float, skip_prob: float, seed: int) -> list[dict]:
    """The SFT problems whose demonstration is one turn, as ``{"prompt", "answer", "demonstration"}`` rows (a
    mixed-policy method's demonstration is one turn; the tool episodes are left out)."""
    return [{"prompt": r["messages"][:1], "answer": p.answer, "demonstration": r["messages"][1]["content"]}
            for p, r in zip(problems, sft_rows(problems, direct_fraction, skip_prob, seed)) if len(r["messages"]) == 2]


def pretrain_rows(problems: list[Problem]) -> list[dict]:
    """A base model's pretraining corpus: the addition task's forgetful solutions, as chats."""
    return [{"messages": user(p) + [{"role": "assistant", "content": arithmetic.forgetful_solution(p)}]}
            for p in problems]


def rl_rows(problems: list[Problem]) -> list[dict]:
    """RL and held-out prompts as ``{"prompt": messages, "answer"}`` rows."""
    return [{"prompt": user(p), "answer": p.answer} for p in problems]
