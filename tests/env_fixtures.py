"""Environments for tests/test_envs.py: a well-behaved one and one that misbehaves on cue. Kept apart from the
test module so the environment process imports only this (no torch)."""

from __future__ import annotations

import os
import signal
import sys
import time

from exactrl.envs.base import Action, StepResult


class Counter:
    """Per-episode state (the running total of sampled ids), every observation form, rewards, done by turn limit
    or on "stop"."""

    def __init__(self, limit: int = 3):
        self.limit, self.total = limit, 0

    def reset(self, row: dict):
        self.prompt = row["prompt"]
        return None if row.get("plain") else f"start {row['prompt']}"

    def step(self, action: Action) -> StepResult:
        self.total += len(action.ids)
        done = action.turn + 1 >= self.limit or "stop" in action.text
        if action.turn == 1:  # the token-id form
            observation = [7, 8, self.total]
        else:
            observation = [{"role": "user", "content": f"{self.prompt}: you said {action.text!r}, {self.total} ids"}]
        return StepResult(observation, float(self.total) if action.finished else None, done, {"turn": action.turn})


def _stubborn():
    while True:  # swallows every interrupt: only a kill ends it
        try:
            time.sleep(3600)
        except BaseException:
            pass


class Scripted(Counter):
    """A Counter that misbehaves when its cue is in the action's text (or, at reset, in the row's "cue")."""

    def _misbehave(self, cue: str):
        if "hang" in cue:
            time.sleep(3600)
        if "alarm" in cue:  # an environment that uses signal.alarm itself (as math-verify does) cancels SIGALRM
            signal.alarm(0)
            time.sleep(3600)
        if "stubborn" in cue:
            _stubborn()
        if "raise" in cue:
            raise ValueError("the move is\nillegal")
        if "exit" in cue:
            sys.exit(3)
        if "crash" in cue:
            os._exit(9)

    def reset(self, row: dict):
        self._misbehave(row.get("cue", ""))
        return super().reset(row)

    def step(self, action: Action):
        self._misbehave(action.text)
        if "nan" in action.text:
            return StepResult("x", float("nan"), False, {})
        if "tuple" in action.text:
            return ("obs", None, "yes", {})
        if "garbage" in action.text:
            return {"observation": "x"}
        if "obs" in action.text:
            return StepResult([{"role": "tool"}], None, False, {})
        if "unpicklable" in action.text:
            return StepResult("x", None, False, {"f": lambda: 0})
        return super().step(action)


class BrokenInit(Counter):
    def __init__(self, size: int = 3):
        raise RuntimeError(f"no board of size {size}")


class NoStep:
    def reset(self, row):
        return None
