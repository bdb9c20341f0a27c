"""Rewards: a Python callable ``module:function(prompts, completions, answers) -> list[float]``.

The built-in task's verifier is ``exactrl.tasks.arithmetic:reward``; math answers are checked
with math-verify by ``exactrl.rewards.mathverify:reward``. A reward function that raises, runs
past ``reward.timeout`` or returns the wrong number of values or non-numbers stops the run with
the sample named -- a silent zero reward would look exactly like a model that learns nothing --
unless ``reward.fallback`` is set: then the samples it failed on get that reward and are counted.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
from collections.abc import Callable

RewardFn = Callable[[list[str], list[str], list[str | None]], list[float]]


class RewardError(RuntimeError):
    """A reward function that could not be loaded or misbehaved on a batch."""


def load_reward_fn(spec: str, timeout: float = 60.0, retries: int = 3) -> RewardFn:
    """``module:function``, or ``http(s)://...`` for a reward server (exactrl/rewards/remote.py)."""
    if spec.startswith(("http://", "https://")):
        from exactrl.rewards.remote import RemoteReward

        return RemoteReward(spec, timeout, retries)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward function '{spec}' must be written module:function, e.g. my_rewards:exact_match")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward function '{spec}': cannot import module '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward function '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn


def _call(fn: RewardFn, prompts, completions, answers, timeout: float | None) -> list:
    """fn on a batch, in a worker thread so a hung call is noticed after ``timeout`` seconds (the
    thread itself cannot be killed; it is left behind, and the run stops or falls back)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return list(pool.submit(fn, prompts, completions, answers).result(timeout=timeout))
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"no result within reward.timeout={timeout:g}s") from None
    finally:
        pool.shutdown(wait=False)


def _check(values: list, spec: str, completions: list[str], sources: list[str]) -> None:
    if len(values) != len(completions):
        raise RewardError(f"reward function '{spec}' returned {len(values)} values for {len(completions)} completions")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward function '{spec}' returned {v!r} for sample {sources[i]} (completion {completions[i]!r}); expected a finite float")


def score(fn: RewardFn, spec: str, prompts: list[str], completions: list[str], answers: list[str | None], sources: list[str],
          timeout: float | None = None, fallback: float | None = None, failures: list | None = None) -> list[float]:
    """Rewards for a batch. If the batch call raises or times out, each sample is scored alone
    to find the ones that fail: they stop the run (named), or get ``fallback`` and are appended
    to ``failures`` as (source, reason)."""
    try:
        values = _call(fn, prompts, completions, answers, timeout)
    except Exception as batch_error:  # a user's function: find the sample(s) it fails on
        values, failed = [], []
        for i in range(len(completions)):
            try:
                (v,) = _call(fn, prompts[i : i + 1], completions[i : i + 1], answers[i : i + 1], timeout)
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                if fallback is None:
                    raise RewardError(f"reward function '{spec}' failed on sample {sources[i]} with {reason} "
                                      "(set reward.fallback to give such samples a fixed reward instead)") from e
                failed.append((sources[i], reason))
                v = fallback
            values.append(v)
        if not failed:
            raise RewardError(f"reward function '{spec}' raised {type(batch_error).__name__}: {batch_error} on the batch "
                              f"starting at {sources[0]}, but on no sample alone") from batch_error
        if failures is not None:
            failures.extend(failed)
    _check(values, spec, completions, sources)
    return [float(v) for v in values]


def load_rewards(fn: str | list[str], weights: list[float] | None, timeout: float = 60.0, retries: int = 3) -> list[tuple[str, float, RewardFn]]:
    """(spec, weight, function) for each configured reward (reward.fn, reward.weights)."""
    specs = [fn] if isinstance(fn, str) else list(fn)
    return [(spec, w, load_reward_fn(spec, timeout, retries)) for spec, w in zip(specs, weights or [1.0] * len(specs))]


def score_all(rewards: list[tuple[str, float, RewardFn]], prompts, completions, answers, sources, timeout=None, fallback=None,
              failures: list | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum of every reward, and each component's values by spec (for logging)."""
    parts = {spec: score(fn, spec, prompts, completions, answers, sources, timeout, fallback, failures) for spec, _, fn in rewards}
    total = [sum(w * parts[spec][i] for spec, w, _ in rewards) for i in range(len(completions))]
    return total, parts
