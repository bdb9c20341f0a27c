"""An environment for tests/test_eval_episodes.py, kept apart from the test module so the environment process
(exactrl/envs/process.py) imports only this and exactrl/envs/base.py (no torch)."""

from __future__ import annotations

from exactrl.envs.base import Action, StepResult


def code(text: str) -> int:
    """0 to 6 (mod 7: a turn of one character repeated 8 times, as the untrained model writes, still varies)."""
    return sum(map(ord, text)) % 7


class Codes:
    """Reads only the turns' texts, so a test recomputes everything it did from them: 2 or 3 turns (the first
    turn's character codes decide), a reward of code/8 per turn (0 to 3/4), a tool call
    counted on a turn whose code is odd, and observations with the running sum of the codes: a 'tool' message
    (rendered by the chat template's delta) after the first turn, plain text after the second. Greedy turns of
    the untrained built-in model (a character repeated) differ from prompt to prompt, and so do these."""

    def reset(self, row: dict):
        self.total, self.turns = 0, 2
        return None  # the row's prompt as loaded

    def step(self, action: Action) -> StepResult:
        c = code(action.text)
        if action.turn == 0:
            self.turns = 2 + c % 2
        self.total += c
        observation = [{"role": "tool", "content": f"sum {self.total}"}] if action.turn == 0 else f" sum {self.total};"
        return StepResult(observation, c / 8, action.turn + 1 >= self.turns, {"tool_calls": c % 2})
