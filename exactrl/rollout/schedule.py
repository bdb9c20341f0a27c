"""When each rollout is sampled, with which weights, and whether its sampling overlaps training.

Synchronous (the default): before rollout n the policy's weights are pushed to the generator (verified:
exactrl/checks/weight_sync.py) and rollout n is sampled with them, so every sample is on-policy
(staleness 0).

Asynchronous (ray.async_rollouts): rollout n+1 is sampled with the weights that are about to train on
rollout n, while they train on it, so each rollout after the first is sampled one update behind the
weights that train on it (staleness 1; the off-policy correction algo.rollout_correction weights it,
exactrl/losses/rollout_gap.py). With ray.max_staleness = k > 1 a push is skipped while the next
rollout would still be at most k updates behind: fewer syncs, staler samples. One rollout is in
flight at a time and weights move only between rollouts, so no rollout spans a sync: every sample
of a rollout carries the one version the schedule recorded for it (checked). The schedule is the
same with and without Ray; only Ray overlaps its two halves (the engines are other processes than
the trainer's ranks): in one process the next rollout is sampled first, then the update runs, and
the numbers are the same (tests/test_async_rollouts.py holds the two runs to the same weights).

Staleness is counted in rollouts (PPO epochs x mini-batches optimizer steps each): a rollout's
staleness is the number of rollouts the policy trained on after the weights that sampled it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from exactrl.data.batch import Sample
from exactrl.distributed.launch import rank


class StaleRolloutError(RuntimeError):
    """A rollout's samples were not all sampled with the weights the schedule pushed for it."""


class RolloutSchedule:
    """``draw(rollout) -> (samples, stats)`` samples and scores a rollout with whatever the generator
    holds; the schedule decides when the policy pushes its weights before that, and whether the
    draw runs beside training (``overlap``: a thread of this process waiting on engines elsewhere)."""

    def __init__(self, policy, generator, check, draw: Callable, max_staleness: int | None, overlap: bool):
        self.policy, self.generator, self.check, self.draw = policy, generator, check, draw
        self.max_staleness = max_staleness or 0  # 0: synchronous
        if self.max_staleness and not overlap and rank() == 0:
            warnings.warn("ray.async_rollouts=true without ray.enabled: the asynchronous schedule runs in sequence "
                          "(each rollout sampled before the previous update, the same numbers as under Ray), so "
                          "nothing overlaps", UserWarning, stacklevel=2)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="exactrl-rollout") \
            if overlap and self.max_staleness else None
        self.pending: tuple[int, Future] | None = None
        self.sync, self.synced_at = None, None  # the last push, and how many rollouts had trained the policy then

    def _start(self, rollout: int, trained: int) -> None:
        """Begin sampling ``rollout`` when the policy has trained on ``trained`` rollouts."""
        pushed = self.synced_at is None or rollout - self.synced_at > self.max_staleness
        if pushed:
            self.sync, self.synced_at = self.policy.push_weights(self.generator, self.check), trained
        s = self.sync
        info = {"weights_version": s.version, "weights_digest": s.digest, "sync_seconds": s.seconds if pushed else 0.0,
                "sync_probe_error": s.probe_error, "staleness": rollout - self.synced_at}
        if self.pool is not None:
            future = self.pool.submit(self._sample, rollout, info)
        else:  # in sequence: the next rollout is sampled now, before the update
            future = Future()
            try:
                future.set_result(self._sample(rollout, info))
            except BaseException as e:  # raised where the result is taken, as the thread's would be
                future.set_exception(e)
        self.pending = (rollout, future)

    def _sample(self, rollout: int, info: dict) -> tuple[list[Sample], dict, float]:
        t0 = time.perf_counter()
        samples, stats = self.draw(rollout)
        return samples, stats | info, time.perf_counter() - t0

    def take(self, rollout: int, rollouts: int) -> tuple[list[Sample], dict, float]:
        """Rollout ``rollout``'s samples, its stats (the weights it was sampled with, its staleness, how
        long training waited for it) and the seconds its sampling took; asynchronously, sampling of
        the next rollout has begun when this returns."""
        if self.pending is None:  # the first rollout of the run (or of a synchronous step)
            self._start(rollout, trained=rollout)
        started, future = self.pending
        assert started == rollout, f"rollout {rollout} asked for while rollout {started} is in flight"
        t0 = time.perf_counter()
        samples, stats, seconds = future.result()
        self.pending = None
        if not self.max_staleness:  # synchronous: the engine is idle until the next push (vLLM's sleep mode)
            freed = getattr(self.generator, "sleep", lambda: None)()
            if freed is not None:  # what the trainer's GPU got back for the update
                stats["engine_sleep_freed_gb"] = freed / 2**30
        stats["rollout_wait_seconds"] = time.perf_counter() - t0
        versions = {s.weights_version for s in samples if s.weights_version is not None}
        if versions - {stats["weights_version"]}:
            raise StaleRolloutError(f"rollout {rollout} holds samples of weights versions {sorted(versions)}, its "
                                    f"schedule pushed version {stats['weights_version']}: a sync landed while it was "
                                    "sampled")
        if stats["staleness"] and any(s.gen_logprobs is None for s in samples if s.source == "on_policy"):
            raise StaleRolloutError(f"rollout {rollout} was sampled {stats['staleness']} update(s) behind "
                                    "(ray.async_rollouts) but its samples carry no generator log-probs to correct "
                                    "that with (a hinted rollout's are not the generator's): set "
                                    "ray.async_rollouts=false for this algorithm")
        if self.max_staleness and rollout + 1 < rollouts:
            self._start(rollout + 1, trained=rollout)
        return samples, stats, seconds

    def close(self) -> None:
        """Stop waiting for a rollout still in flight (a failed run: the engines are ended next)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
