"""Asynchronous rollouts (ray.async_rollouts, exactrl/rollout/schedule.py): which weights sample
each rollout, how stale it is, and that the schedule is what a real run does.

The schedule's arithmetic is checked on a counting fake (which trainer state sampled each rollout,
for max_staleness 1 and 2, and that the sampling really runs beside "training" when it overlaps).
The real run is checked against the synchronous run of the same seed, computed by the other path:
the asynchronous run's rollout 0 and the update on it are the synchronous run's, so its rollouts 1
and 2 are sampled with the weights the synchronous run sampled rollouts 0 and 1 with (the weights
digests of metrics.jsonl, bytes); the trainer's recomputation measures the update between the
weights that sampled a stale rollout and those training on it, and meets the generator's where
they are the same."""

from __future__ import annotations

import json
import threading
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from exactrl.algorithms.rl import train_rl
from exactrl.config import ConfigError, RLConfig, load_config
from exactrl.rollout.schedule import RolloutSchedule, StaleRolloutError
from exactrl.tasks.builtin import BuiltinSpec


@dataclass
class Report:
    version: int
    digest: str = "d"
    seconds: float = 0.0
    probe_error: float = 0.0


@dataclass
class FakeSample:
    weights_version: int | None
    gen_logprobs: object = 1.0
    source: str = "on_policy"


class Trainer:
    """The policy's state is a counter of updates; a push copies it to the generator."""

    def __init__(self):
        self.updates, self.pushes = 0, 0

    def push_weights(self, generator, check):
        self.pushes += 1
        generator.weights, generator.version = self.updates, self.pushes
        return Report(self.pushes)


class Engine:
    weights = version = None

    def draw(self, rollout):
        return [FakeSample(self.version)], {"generated_tokens": 1, "sampled_with": self.weights}


def drive(max_staleness, rollouts=6, overlap=False):
    trainer, engine = Trainer(), Engine()
    schedule = RolloutSchedule(trainer, engine, None, engine.draw, max_staleness, overlap)
    seen = []
    for n in range(rollouts):
        _, stats, _ = schedule.take(n, rollouts)
        seen.append((stats["sampled_with"], stats["staleness"]))
        trainer.updates += 1  # the update on rollout n
    schedule.close()
    return seen, trainer.pushes


def test_synchronous_samples_each_rollout_with_the_current_weights():
    seen, pushes = drive(None)
    assert seen == [(n, 0) for n in range(6)] and pushes == 6


def test_one_step_stale_samples_rollout_n_with_the_weights_before_the_update_on_n_minus_1():
    seen, pushes = drive(1)
    # rollout n >= 1 is sampled before the update on rollout n-1, with the weights of the updates on rollouts 0..n-2:
    # staleness 1; and no push is spent on weights that did not move (rollout 1 is sampled with rollout 0's)
    assert seen == [(0, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 1)] and pushes == 5


def test_max_staleness_two_pushes_only_when_the_next_rollout_would_be_three_behind():
    seen, pushes = drive(2)
    assert seen == [(0, 0), (0, 1), (0, 2), (2, 1), (2, 2), (4, 1)] and pushes == 3
    assert max(s for _, s in seen) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_changes_nothing_but_where_the_sampling_runs(overlap):
    assert drive(1, overlap=overlap) == drive(1)


def test_overlapping_sampling_runs_while_the_trainer_trains():
    """Rollout 1's sampling waits for the update on rollout 0 to have begun: it can only finish if it runs
    beside it (in sequence it would wait in vain and the event's timeout would say so)."""
    training = threading.Event()
    trainer, engine = Trainer(), Engine()

    def draw(n):
        if n == 1:
            assert training.wait(timeout=10), "rollout 1 was sampled in sequence, not beside the update"
        return engine.draw(n)

    schedule = RolloutSchedule(trainer, engine, None, draw, 1, overlap=True)
    schedule.take(0, 2)
    training.set()  # the update on rollout 0 begins...
    trainer.updates += 1
    _, stats, _ = schedule.take(1, 2)  # ...and rollout 1, sampled meanwhile, arrives
    assert stats["staleness"] == 1 and stats["sampled_with"] == 0


def test_a_rollout_with_samples_of_another_weights_version_stops_the_run():
    trainer, engine = Trainer(), Engine()
    schedule = RolloutSchedule(trainer, engine, None, lambda n: ([FakeSample(engine.version),
                                                                  FakeSample(engine.version - 1)], {}), None, False)
    with pytest.raises(StaleRolloutError, match=r"rollout 0 holds samples of weights versions \[0, 1\]"):
        schedule.take(0, 3)


def test_a_stale_rollout_without_generator_log_probs_is_refused():
    trainer, engine = Trainer(), Engine()
    schedule = RolloutSchedule(trainer, engine, None, lambda n: ([FakeSample(engine.version, None)], {}), 1, False)
    schedule.take(0, 3)  # staleness 0: nothing to correct
    with pytest.raises(StaleRolloutError, match="carry no generator log-probs"):
        schedule.take(1, 3)


def test_a_failed_sampling_is_raised_where_the_rollout_is_taken():
    trainer, engine = Trainer(), Engine()

    def draw(n):
        if n == 1:
            raise RuntimeError("engine lost")
        return engine.draw(n)

    schedule = RolloutSchedule(trainer, engine, None, draw, 1, overlap=True)
    schedule.take(0, 3)
    with pytest.raises(RuntimeError, match="engine lost"):
        schedule.take(1, 3)
    schedule.close()


def test_what_asynchronous_rollouts_cannot_honour_is_refused():
    with pytest.raises(ConfigError, match="set algo.rollout_correction"):
        load_config(RLConfig, None, ["ray.async_rollouts=true"])
    with pytest.raises(ConfigError, match="resume with ray.async_rollouts=false"):
        load_config(RLConfig, None, ["ray.async_rollouts=true", "algo.rollout_correction=tis",
                                     "train.resume_from=/nowhere"])


SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
COMMON = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
          "train.max_steps=4", "train.log_every=1", "rollout.max_new_tokens=8", "model.dtype=fp32", "optim.lr=1e-3",
          "algo.rollout_correction=tis", "reward.fn=reward_fixtures:varied"]


def records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXACTRL_CACHE", str(root / "cache"))
        out = {}
        for name, extra in (("sync", []), ("async", ["ray.async_rollouts=true"])):
            with pytest.warns(UserWarning, match="runs in sequence") if extra else nullcontext():
                train_rl(load_config(RLConfig, None, [*COMMON, *extra, f"output_dir={root / name}"]), spec=SPEC)
            out[name] = root / name
        yield out


def test_an_async_rollout_is_sampled_with_the_weights_the_sync_run_sampled_the_one_before_with(runs):
    sync, lagged = records(runs["sync"]), records(runs["async"])
    assert [r["staleness"] for r in sync] == [0, 0, 0, 0] and [r["staleness"] for r in lagged] == [0, 1, 1, 1]
    digests = [r["weights_digest"] for r in sync]
    assert len(set(digests)) == 4  # every update moved the weights
    # rollout 0 and the update on it are the synchronous run's, so rollouts 1 and 2 are sampled with the weights the
    # synchronous run sampled rollouts 0 and 1 with; rollout 3's weights have trained on the stale rollout 1, which
    # the synchronous run never sampled: they are no weights of that run
    lagged_digests = [r["weights_digest"] for r in lagged]
    assert lagged_digests[:3] == [digests[0], digests[0], digests[1]] and lagged_digests[3] not in digests
    assert lagged[0]["reward_mean"] == sync[0]["reward_mean"] and lagged[0]["loss"] == sync[0]["loss"]
    # the trainer's recomputation meets the generator's log-probs where the weights are the same, and measures the
    # update between them where they are not
    print("gap abs_max sync", [r["rollout_gap/abs_max"] for r in sync], "async",
          [r["rollout_gap/abs_max"] for r in lagged])
    assert all(r["rollout_gap/abs_max"] <= 1e-4 for r in sync) and lagged[0]["rollout_gap/abs_max"] <= 1e-4
    assert all(r["rollout_gap/abs_max"] > 1e-3 for r in lagged[1:])


def test_the_async_run_trains_on_other_samples_so_ends_elsewhere(runs):
    a, b = (load_file(runs[n] / "final" / "model.safetensors") for n in ("sync", "async"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-5
