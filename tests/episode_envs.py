"""An environment for the multi-turn placement tests (tests/test_multiturn_placement.py), kept apart from the test
module so the environment process (exactrl/envs/process.py) imports only this and exactrl/envs/base.py (no torch).
"""

from __future__ import annotations

import time

from exactrl.envs.base import Action, StepResult


class Tally:
    """Counts the digits the policy writes and answers every turn: 2 or 3 policy turns per episode (the first
    turn's sampled ids decide), a reward per turn that depends on the text (its share of digits, so groups differ
    and there is something to learn) except on odd turns, and each observation form once: a 'tool' message
    (rendered by the chat template's delta), plain text, token ids."""

    def __init__(self, ids_turn: list[int] | None = None, delay: float = 0.0):
        self.ids_turn = ids_turn or [5, 6]  # the token-id observation (within the built-in vocabulary)
        self.delay = delay  # seconds each step takes (a slow tool)

    def reset(self, row: dict):
        self.digits, self.turns = 0, 2
        return None  # the row's prompt as loaded

    def step(self, action: Action) -> StepResult:
        time.sleep(self.delay)
        if action.turn == 0:
            self.turns = 2 + sum(action.ids) % 2
        digits = sum(ch.isdigit() for ch in action.text)
        self.digits += digits
        done = action.turn + 1 >= self.turns
        reward = None if action.turn % 2 else digits / (1 + len(action.text))
        form = action.turn % 3
        if form == 0:
            observation = [{"role": "tool", "content": f"{self.digits} digits"}]
        elif form == 1:
            observation = f" so far {self.digits};"
        else:
            observation = list(self.ids_turn)
        return StepResult(observation, reward, done, {"tool_calls": int(digits > 0)})
