"""The environment interface: an episode is reset once, then stepped once per policy turn.

    reset(row) -> None | str | list[dict] | list[int]      the episode's opening (None: the row's prompt as loaded)
    step(action) -> StepResult(observation, reward, done, info)

``row`` is the data row the episode starts from ({"prompt", "answer", "source", and any other column}).
``action`` carries what the policy sampled this turn: its token ids exactly as sampled and their text.
An observation is what the policy sees next, in one of three forms (envs/render.py turns it into ids):
- a list of chat messages ({"role": "tool" | "user" | ..., "content": str}), rendered once by the chat
  template's delta for them;
- a str, encoded once as it is (no special tokens added);
- a list of token ids, appended as given.
Nothing the policy sampled is ever decoded and re-encoded into the trajectory: the text is for the
environment to read, the ids are what is trained (DESIGN.md, "A trajectory is token ids, never text").

A user's environment is a plain class (``env.cls=module:Class``, constructed with ``env.args``, one instance
per episode) run in a process of its own with a hard time limit per call (envs/process.py), or a server
(``env.url``, envs/remote.py). ``reward`` of a step is that turn's reward (None: none); the trajectory's
reward is the sum of its turns' rewards plus, with env.reward_fn, reward.fn's score of the final turn's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

Observation = str | list | None  # None | str | list[dict] (messages) | list[int] (token ids)


@dataclass(frozen=True)
class Action:
    ids: list[int]  # the turn's token ids, exactly as the generator sampled them
    text: str  # their text (special tokens skipped): what the environment reads
    finished: bool  # the turn ended by EOS or a stop string (False: its token budget ran out)
    turn: int  # 0 for the first policy turn


@dataclass(frozen=True)
class StepResult:
    observation: Observation = None  # what the policy sees next (ignored when done)
    reward: float | None = None  # this turn's reward
    done: bool = False
    info: dict = field(default_factory=dict)  # free-form; "tool_calls": n is counted in the rollout's metrics


class Environment(Protocol):
    def reset(self, row: dict) -> Observation: ...

    def step(self, action: Action) -> StepResult: ...


class EnvError(RuntimeError):
    """An environment broke its contract (raised, hung past env.timeout, returned something malformed)."""


def check_observation(obs, where: str) -> Observation:
    """``obs`` if it is one of the three forms, else a one-line error naming ``where`` and what was given."""
    if obs is None or isinstance(obs, str):
        return obs
    if isinstance(obs, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in obs):
        return obs
    if isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                     and isinstance(m.get("content"), str) for m in obs):
        return obs
    raise EnvError(f"{where} returned {type(obs).__name__} {str(obs)[:80]!r}: an observation is None, a "
                            "str, a list of token ids, or a list of {'role': str, 'content': str} messages")


def check_step(result, where: str) -> StepResult:
    """``result`` as a StepResult (a (observation, reward, done, info) tuple is accepted), checked."""
    if isinstance(result, tuple) and len(result) == 4:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise EnvError(f"{where} returned {type(result).__name__}: step returns a StepResult or a tuple "
                                "(observation, reward, done, info)")
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or reward != reward or abs(reward) == float("inf")):
        raise EnvError(f"{where} returned reward {reward!r}: a finite number or None")
    if not isinstance(result.done, bool):
        raise EnvError(f"{where} returned done={result.done!r}: True or False")
    if not isinstance(result.info, dict):
        raise EnvError(f"{where} returned info of type {type(result.info).__name__}: a dict")
    check_observation(result.observation, where)
    return StepResult(result.observation, None if reward is None else float(reward), result.done, result.info)
