"""Rewards: a Python callable ``module:function(prompts, completions, answers) -> list[float]``.

The built-in task's verifier is ``exactrl.tasks.arithmetic:reward``; math answers are checked
with math-verify by ``exactrl.rewards.mathverify:reward``. Python rewards run in a process of
their own (exactrl/rewards/worker.py), one call per batch, so a reward may use signals, hang or
crash without taking the run with it; reward servers (``http://...``) are called from here.

A batch that runs past ``reward.timeout``, kills its process or calls ``sys.exit`` stops the
run naming the reward and the batch; a reward that raises is then called on each sample alone
(within one more ``reward.timeout`` in all) to name the sample it fails on. A silent zero reward
would look exactly like a model that learns nothing, so nothing is scored 0 in secret: with
``reward.fallback`` set, the failed samples (the whole batch, for a timeout or a crash) get that
reward instead and are counted in ``reward_failures``.

Every row must carry an ``answer`` unless the function says it needs none
(``my_reward.needs_answer = False``); a row without one is an error naming its file:line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from exactrl.data.jsonl import DataError
from exactrl.rewards.worker import RewardWorker, WorkerDied, WorkerRaised, WorkerTimeout

DEFAULT_TIMEOUT = 60.0


class RewardError(RuntimeError):
    """A reward function that could not be loaded or misbehaved on a batch."""


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class Reward:
    """One configured reward: its spec, weight, whether rows need an answer, and the call."""

    def __init__(self, spec: str, weight: float, needs_answer: bool, call):
        self.spec, self.weight, self.needs_answer, self._call = spec, weight, needs_answer, call

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None],
                 timeout: float | None = None) -> list:
        return self._call(prompts, completions, answers, timeout)


class Rewards:
    """The rewards of a run (summed with their weights) and the one evaluation scores with,
    sharing one reward process. Iterating gives the training rewards. Close it (or use
    ``with``) to stop the process; it also stops by itself when this process ends."""

    def __init__(self, specs: str | list[str], weights: list[float] | None = None, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = 3, eval_spec: str | None = None):
        specs = [specs] if isinstance(specs, str) else list(specs)
        wanted = list(dict.fromkeys(specs + ([eval_spec] if eval_spec else [])))
        python = [s for s in wanted if not _is_url(s)]
        try:
            self._worker = RewardWorker(python) if python else None
        except (ValueError, RuntimeError) as e:
            raise RewardError(str(e)) from None
        loaded = {s: self._load(s, timeout, retries) for s in wanted}
        self.train = [Reward(s, w, loaded[s].needs_answer, loaded[s]._call) for s, w in zip(specs, weights or [
            1.0] * len(specs))]
        self.eval = loaded[eval_spec] if eval_spec else self.train[0]
        # reward.model's scorer (workers/reward_model.py ModelReward), set by the run once its workers exist: it
        # scores token ids, not text, so collect.py adds it after the rollout is gathered (add_model_reward)
        self.model = None
        # env.*'s episode runner (rollout/multiturn.py), set by the run: its environments share the reward's
        # isolation (a process of their own, a time limit per call) and are closed with it
        self.episodes = None

    def _load(self, spec: str, timeout: float, retries: int) -> Reward:
        if _is_url(spec):
            from exactrl.rewards.remote import RemoteReward

            remote = RemoteReward(spec, timeout, retries)
            # A server's needs are its own: it gets null answers and should refuse them (the
            # reference server, exactrl/rewards/server.py, does so for functions that need them).
            return Reward(spec, 1.0, False, lambda p, c, a, t: remote(p, c, a))
        worker = self._worker
        return Reward(spec, 1.0, worker.needs_answer[spec], lambda p, c, a, t: worker.call(spec, p, c, a, t))

    def __iter__(self):
        return iter(self.train)

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, i: int) -> Reward:
        return self.train[i]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self.episodes is not None:
            self.episodes.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_rewards(fn: str | list[str], weights: list[float] | None = None, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = 3,
                 eval_spec: str | None = None) -> Rewards:
    """Every configured reward (reward.fn, reward.weights), plus ``eval_spec`` for evaluation if given."""
    return Rewards(fn, weights, timeout, retries, eval_spec)


def load_reward_fn(spec: str, timeout: float = DEFAULT_TIMEOUT, retries: int = 3) -> Reward:
    """One reward, ``module:function`` or ``http(s)://...`` (exactrl/rewards/remote.py)."""
    return Rewards(spec, None, timeout, retries)[0]


def require_answers(prompts: Iterable, rewards: Iterable[Reward], role: str) -> None:
    """Every row has the answer each reward needs, or a DataError names the first that lacks it."""
    needing = [r for r in rewards if r.needs_answer]
    if not needing:
        return
    for p in prompts:
        if p.answer is None:
            raise DataError(f"{p.source}: no 'answer', which {role} '{needing[0].spec}' needs to score this prompt; "
                            "give every row an \"answer\" (a reward that needs none sets `needs_answer = False` on "
                            "its function)")


def _check(values: list, spec: str, completions: list[str], sources: list[str]) -> None:
    if len(values) != len(completions):
        raise RewardError(f"reward function '{spec}' returned {len(values)} values for {len(completions)} completions")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward function '{spec}' returned {v!r} for sample {sources[i]} (completion "
                              f"{completions[i]!r}); expected a finite float")


def _batch_name(sources: list[str], shown: int = 3) -> str:
    """A batch by the rows its samples came from, the first ``shown`` in its order (a rollout draws its prompts
    shuffled: a first .. last range would name rows the batch does not hold)."""
    if len(sources) == 1:
        return sources[0]
    rows = list(dict.fromkeys(sources))  # a group's samples share their prompt's row
    files = {s.rpartition(":")[0] for s in rows}
    if len(files) == 1 and all(s.rpartition(":")[2].isdigit() for s in rows):
        names = f"{files.pop()} rows " + ", ".join(s.rpartition(":")[2] for s in rows[:shown])
    else:
        names = ", ".join(rows[:shown])
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return f"of {len(sources)} samples (from {names}{more})"


def _isolate(reward: Reward, prompts, completions, answers, sources, timeout, fallback, batch_error) -> tuple[
    list, list]:
    """Each sample alone, to find the ones the reward raises on; all of it within one more
    ``timeout``. Returns (values, [(source, reason)]) or raises naming the first failing sample."""
    deadline = None if timeout is None else time.monotonic() + timeout
    values, failed = [], []
    for i in range(len(completions)):
        left = None if deadline is None else deadline - time.monotonic()
        try:
            if left is not None and left <= 0:
                raise WorkerTimeout("not scored: finding the failing samples took longer than "
                                    f"reward.timeout={timeout:g}s")
            (v,) = reward(prompts[i : i + 1], completions[i : i + 1], answers[i : i + 1], left)
        except (WorkerRaised, WorkerTimeout, WorkerDied, ValueError) as e:
            reason = f"{type(e).__name__}: {e}" if isinstance(e, ValueError) else str(e)
            if isinstance(e, WorkerTimeout) and left is not None and left > 0:  # the call had only what was left
                reason = (f"no result within what was left of reward.timeout={timeout:g}s (the reward process was "
                          "killed)")
            if fallback is None:
                raise RewardError(f"reward function '{reward.spec}' failed on sample {sources[i]} with {reason} "
                                  "(set reward.fallback to give such samples a fixed reward instead)") from None
            failed.append((sources[i], reason))
            v = fallback
        values.append(v)
    if not failed:
        raise RewardError(f"reward function '{reward.spec}' raised {batch_error} on the batch {_batch_name(sources)}, "
                          "but on no sample alone")
    return values, failed


def score(reward: Reward, prompts: list[str], completions: list[str], answers: list[str | None], sources: list[str],
          timeout: float | None = DEFAULT_TIMEOUT, fallback: float | None = None,
          failures: list | None = None) -> list[float]:
    """Rewards for a batch, one call; failures as in this module's docstring. Failed samples
    that got ``fallback`` are appended to ``failures`` as (source, reason)."""
    try:
        values = reward(prompts, completions, answers, timeout)
        failed = []
    except WorkerRaised as e:  # a user's function raised: find the sample(s) it fails on
        values, failed = _isolate(reward, prompts, completions, answers, sources, timeout, fallback, e)
    except Exception as e:  # a timeout, a dead process, a server that failed: the whole batch
        reason = str(e) if isinstance(e, (WorkerTimeout, WorkerDied)) else f"{type(e).__name__}: {e}"
        if fallback is None:
            raise RewardError(f"reward function '{reward.spec}' failed on the batch {_batch_name(sources)}: {reason} "
                              "(set reward.fallback to give such a batch a fixed reward instead)") from None
        values, failed = [fallback] * len(completions), [(s, reason) for s in sources]
    if failures is not None:
        failures.extend(failed)
    _check(values, reward.spec, completions, sources)
    return [float(v) for v in values]


def score_all(rewards: Iterable[Reward], prompts, completions, answers, sources, timeout=DEFAULT_TIMEOUT, fallback=None,
              failures: list | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum of every reward, and each component's values by spec (for logging)."""
    rewards = list(rewards)
    parts = {r.spec: score(r, prompts, completions, answers, sources, timeout, fallback, failures) for r in rewards}
    total = [sum(r.weight * parts[r.spec][i] for r in rewards) for i in range(len(completions))]
    return total, parts
