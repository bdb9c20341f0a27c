"""Multi-turn test fixtures shared by tests/test_multiturn.py, tests/test_multiturn_exactness.py and
tests/dist/multiturn_references.py: an in-process environment pool, environments, and generators that sample
what they are told (rollout/multiturn.py's EpisodeRunner drives them)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from exactrl.envs.base import Action, EnvError, StepResult, check_step
from exactrl.rollout.generator import Generation


class LocalPool:
    """The pool interface (envs/process.py) in this process: one ``make()`` per episode."""

    def __init__(self, make):
        self.make, self.envs = make, {}

    def reset(self, episodes):
        out = []
        for uid, row in episodes:
            self.envs[uid] = self.make()
            out.append(self.envs[uid].reset(row))
        return out

    def step(self, actions):
        out = []
        for uid, action in actions:
            try:
                out.append(check_step(self.envs[uid].step(action), "env"))
            except Exception as e:  # the process pool turns these into EnvError too
                out.append(EnvError(f"env episode {uid}: {e}"))
        return out

    def end(self, ids):
        for uid in ids:
            self.envs.pop(uid, None)

    def close(self):
        self.envs.clear()


class Echo:
    """Answers every turn with 'ok<n>' until the third, which ends the episode; reward 0.5 per turn."""

    def reset(self, row):
        self.turns = []
        return None

    def step(self, action: Action):
        self.turns.append(action)
        return StepResult(f"ok{len(self.turns)}", 0.5, done=len(self.turns) == 3, info={"tool_calls": 1})


class Chatty:
    """Episodes of very different shapes, decided by the sampled ids alone (so every rank builds the same): 1 to 4
    turns (the first turn's ids say how many), each answered by a user message of 0 to 40 characters (the chat
    template wraps it in its own tokens), a reward on some steps and None on others."""

    def reset(self, row):
        self.turns = 0
        return None

    def step(self, action: Action):
        self.turns += 1
        if action.turn == 0:
            self.last = 1 + sum(action.ids) % 4
        size = (sum(action.ids) * 7 + action.turn * 13) % 41
        reward = None if size % 3 == 0 else (size % 5) / 4
        return StepResult([{"role": "user", "content": "".join("abc xyz=+#"[(size + k) % 10] for k in range(size))}],
                          reward, done=self.turns >= self.last)


def env_cfg(**kw):
    return SimpleNamespace(max_turns=kw.get("max_turns", 4), max_tokens=kw.get("max_tokens", 64),
                           on_error=kw.get("on_error", "end"))


class Scripted:
    """A generator that samples what it is told: turn k's ids, with made-up log-probs."""

    logprobs_over = "vocabulary"

    def __init__(self, turns):
        self.turns, self.calls = turns, 0

    def generate(self, prompt_ids, params, seeds):
        out = []
        for i, ids in enumerate(prompt_ids):
            resp = self.turns[self.calls % len(self.turns)]
            out.append(Generation(i, list(ids), list(resp), "", True, [-0.25 - 0.01 * j for j in range(len(resp))]))
        self.calls += 1
        return out


class SeededTurns:
    """A generator whose turn is drawn from the turn's seed alone: 1 to ``longest`` ids among ``ids``, ending in EOS
    half the time, with made-up log-probs (rows of very different lengths, the same on every rank)."""

    logprobs_over = "vocabulary"

    def __init__(self, tokenizer, ids: range, longest: int = 14):
        self.tok, self.ids, self.longest = tokenizer, ids, longest

    def generate(self, prompt_ids, params, seeds):
        out = []
        for i, (prompt, seed) in enumerate(zip(prompt_ids, seeds)):
            rng = random.Random(seed)
            resp = [rng.choice(self.ids) for _ in range(rng.randint(1, self.longest))]
            finished = rng.random() < 0.5
            if finished:
                resp[-1] = self.tok.eos_token_id
            resp = resp[: params.max_new_tokens]
            out.append(Generation(i, list(prompt), resp, self.tok.decode(resp, skip_special_tokens=True), finished,
                                  [-0.1 - rng.random() for _ in resp]))
        return out
