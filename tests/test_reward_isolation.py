"""Rewards run in a process of their own, one call and one time limit per batch: a reward that
hangs, exits or crashes stops the run with the reward and batch named (or, with
reward.fallback, costs one timeout per batch), a raising reward names its sample, and rewards
that need the main thread (math-verify's signal.alarm) work. The functions are in
tests/reward_fixtures.py; tests/test_reward_runs.py drives the same cases through `exactrl rl`."""

from __future__ import annotations

import time

import pytest

from exactrl.data.encode import Prompt
from exactrl.data.jsonl import DataError
from exactrl.rewards import RewardError, load_reward_fn, load_rewards, require_answers, score

SRC = ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"]


def run(spec, completions=("a", "x", "b"), **kw):
    with load_rewards(spec) as rewards:
        return score(rewards[0], ["p"] * len(completions), list(completions), [None] * len(completions),
                     SRC[: len(completions)], **kw)


def test_a_raising_reward_names_the_sample_or_gets_the_fallback():
    with pytest.raises(RewardError,
                       match="'reward_fixtures:raises_on_x' failed on sample d.jsonl:2 with ValueError: cannot "
                             "score an x"):
        run("reward_fixtures:raises_on_x")
    failures: list = []
    assert run("reward_fixtures:raises_on_x", ("ab", "x", "abcd"), fallback=-1.0, failures=failures) == [2.0, -1.0, 4.0]
    assert failures == [("d.jsonl:2", "ValueError: cannot score an x")]
    with pytest.raises(RewardError, match="failed on sample d.jsonl:1 with KeyError"):
        run("reward_fixtures:raises_key_error")
    with pytest.raises(RewardError,
                       match=r"raised RuntimeError: batched call broken on the batch of 3 samples \(from d.jsonl "
                             r"rows 1, 2, 3\), but on no sample alone"):
        run("reward_fixtures:batch_only_bug", fallback=0.0)


def test_a_failed_batch_is_named_by_the_rows_it_holds():
    """A rollout's prompts are drawn shuffled and each comes group_size times: the batch is named by its rows in
    its order, the first three of them, not by a first .. last range of rows it may not hold."""
    from exactrl.rewards import Reward

    def down(*args):
        raise ConnectionError("reward server down")

    rows = [6941, 6941, 14512, 14512, 20, 20, 7000, 7000]
    with pytest.raises(RewardError) as info:
        score(Reward("http://127.0.0.1:9/", 1.0, False, down), ["p"] * 8, ["c"] * 8, [None] * 8,
              [f"data/rl_train.jsonl:{r}" for r in rows])
    assert str(info.value) == ("reward function 'http://127.0.0.1:9/' failed on the batch of 8 samples (from "
                               "data/rl_train.jsonl rows 6941, 14512, 20 and 1 more): ConnectionError: reward server "
                               "down (set reward.fallback to give such a batch a fixed reward instead)")
    with pytest.raises(RewardError, match=r"the batch of 2 samples \(from a.jsonl:3, b.jsonl:1\)"):
        score(Reward("x", 1.0, False, down), ["p"] * 2, ["c"] * 2, [None] * 2, ["a.jsonl:3", "b.jsonl:1"])


def test_bad_values_and_bad_specs_are_named():
    with pytest.raises(RewardError, match="returned 1 values for 3"):
        run("reward_fixtures:too_few")
    with pytest.raises(RewardError, match="nan.*d.jsonl:1"):
        run("reward_fixtures:nan")
    with pytest.raises(RewardError, match="module:function"):
        load_reward_fn("no_colon")
    with pytest.raises(RewardError, match="cannot import module"):
        load_reward_fn("surely_not_a_module_xyz:f")
    with pytest.raises(RewardError, match="no callable 'nope'"):
        load_reward_fn("exactrl.tasks.arithmetic:nope")
    fn = load_reward_fn("exactrl.tasks.arithmetic:reward")
    assert score(fn, ["1+2="] * 2, ["#### 003", "#### 4"], ["3", "3"], SRC[:2]) == [1.0, 0.0]


@pytest.mark.parametrize("spec, says", [("reward_fixtures:hangs", r"no result within reward.timeout=1s"),
                                        ("reward_fixtures:exits", r"the reward called sys.exit\(0\)"),
                                        ("reward_fixtures:os_exits", r"the reward process died \(exit code 0")])
def test_a_hung_or_exiting_reward_fails_its_batch_once(spec, says):
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=rf"'{spec}' failed on the batch of 3 samples \(from d.jsonl rows 1, 2, 3\): "
                                          f"{says}"):
        run(spec, timeout=1.0)
    failures: list = []
    # With a fallback the whole batch gets it after one timeout, not one per sample.
    assert run(spec, timeout=1.0, fallback=-1.0, failures=failures) == [-1.0] * 3
    assert [s for s, _ in failures] == SRC
    assert time.perf_counter() - t0 < 2 * 1.0 + 3.0  # two batches, each at most one timeout (+ process starts)


def test_finding_the_failing_samples_takes_one_more_timeout_at_most():
    failures: list = []
    t0 = time.perf_counter()
    assert run("reward_fixtures:raises_then_hangs", ("a", "h", "b"), timeout=1.0, fallback=-1.0,
               failures=failures) == [1.0, -1.0, -1.0]
    assert time.perf_counter() - t0 < 1.0 + 2.0  # the batch raised at once; the search had one timeout in all
    assert failures == [("d.jsonl:2",
                         "no result within what was left of reward.timeout=1s (the reward process was killed)"),
                        ("d.jsonl:3", "not scored: finding the failing samples took longer than reward.timeout=1s")]


def test_the_process_is_replaced_after_a_timeout_and_reaped_on_close():
    with load_rewards(["reward_fixtures:hangs_on_x", "reward_fixtures:length"]) as rewards:
        worker = rewards._worker
        first = worker._proc
        with pytest.raises(RewardError, match="no result within reward.timeout=0.5s"):
            score(rewards[0], ["p"], ["x"], [None], SRC[:1], timeout=0.5)
        assert first.returncode is not None  # killed and waited for: no zombie
        assert score(rewards[1], ["p"], ["abc"], [None], SRC[:1], timeout=5) == [0.3]  # a fresh process serves on
        second = worker._proc
        assert second is not first and second.poll() is None
    assert second.returncode is not None and worker._proc is None


def test_signal_alarm_and_math_verify_work_in_the_reward_process():
    assert run("reward_fixtures:uses_alarm") == [1.0] * 3
    completions = ["so the answer is $\\boxed{\\frac{1}{2}}$", "I get $0.5$", "the answer is $\\boxed{\\frac{1}{3}}$",
                   "$x = 2$",
                   "no idea"]
    answers = ["0.5", "\\frac{1}{2}", "1/2", "2", "7"]
    with load_rewards("exactrl.rewards.mathverify:reward") as rewards:
        got = score(rewards[0], [""] * 5, completions, answers, [f"m:{i}" for i in range(5)])
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_rows_without_the_answer_a_reward_needs_are_named():
    prompts = [Prompt([1], "p", "3", "d.jsonl:1"), Prompt([1], "q", None, "d.jsonl:2")]
    with load_rewards(["exactrl.tasks.arithmetic:reward", "reward_fixtures:length"]) as rewards:
        assert [r.needs_answer for r in rewards] == [True, False]
        with pytest.raises(DataError,
                           match="d.jsonl:2: no 'answer', which reward.fn 'exactrl.tasks.arithmetic:reward' needs"):
            require_answers(prompts, rewards, "reward.fn")
        require_answers(prompts, [rewards[1]], "reward.fn")  # needs_answer = False: nothing to check


def test_process_hop_costs_little_per_batch():
    """The figure reported in docs/data.md ("Rewards"): the hop to the reward process, per rollout-sized batch."""
    from exactrl.tasks.arithmetic import reward

    n = 256
    batch = (["1+2="] * n, ["#### 003"] * n, ["3"] * n, [f"d:{i}" for i in range(n)])
    with load_rewards("exactrl.tasks.arithmetic:reward") as rewards:
        score(rewards[0], *batch)
        t0 = time.perf_counter()
        for _ in range(20):
            assert score(rewards[0], *batch) == [1.0] * n
        hop = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(20):
        reward(*batch[:3])
    direct = (time.perf_counter() - t0) / 20
    assert hop - direct < 0.05  # measured ~0.2 ms for 256 samples; generous for a loaded CI machine


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "in-a-batch"])
def test_the_reward_process_ends_when_the_run_is_killed(tmp_path, busy):
    """Idle, it sees its socket close; in the middle of a batch, that its parent changed."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    started = tmp_path / "started"
    code = ("from exactrl.rewards import load_rewards; r = load_rewards('reward_fixtures:hangs_after_touching'); "
            "print(r._worker._proc.pid, flush=True); import time\n"
            + (f"r._worker.call('reward_fixtures:hangs_after_touching', [{str(started)!r}], ['c'], [None], None)"
               if busy
               else "time.sleep(60)"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    child = int(run.stdout.readline())
    deadline = time.monotonic() + 10
    while busy and not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)  # no finalizer, no atexit
    run.wait()
    status = Path(f"/proc/{child}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = not status.exists() or "State:\tZ" in status.read_text()
    if not ended:
        os.kill(child, signal.SIGKILL)  # not left for the rest of the suite
    assert ended
