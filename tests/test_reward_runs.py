"""Rewards and evaluation through the path a run takes: `exactrl rl` on the command line, on a
small model and data files of the test's own. Every shipped reward trains and evaluates; a
reward that hangs, exits or raises ends the run promptly with a non-zero exit and a message
naming the reward and the batch or sample; with reward.fallback a hung reward costs one
timeout per rollout; evaluation scores with the run's reward and never on the built-in
problems for a user's data; rows without the answer a reward needs are named; and a failing
final evaluation leaves the trained model in final/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SMALL
from exactrl.config import ConfigError, SFTConfig, load_config
from exactrl.rewards.server import make_server
from exactrl.tasks.tiny_model import save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(12, 34), (50, 7), (81, 18), (3, 99)]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_runs")
    save_tiny_model(root / "model", save_tokenizer(root / "model"), seed=0, **SMALL)
    return {"root": root, "model": root / "model", "train": write_jsonl(root / "train.jsonl", ROWS),
            "eval": write_jsonl(root / "eval.jsonl", ROWS[:2]),
            "no_answer": write_jsonl(root / "no_answer.jsonl", [{"prompt": r["prompt"], "completion": "#### 1"}
                                                                for r in ROWS]),
            "bad": write_jsonl(root / "bad.jsonl", [ROWS[0], {"prompt": "bad+1=", "answer": "1"}])}


def rl(files, name, *overrides, timeout=300):
    """`exactrl rl` for two steps of 8 responses (2 prompts x 4); returns (process, run dir, seconds)."""
    out = files["root"] / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXACTRL_CACHE": str(files["root"] / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    args = ["rl", f"model.path={files['model']}", f"data.train={files['train']}", "data.eval=null", "train.max_steps=2",
            "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4", "rollout.max_new_tokens=8",
            "eval.max_new_tokens=8", "train.log_every=1", f"output_dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True,
                          timeout=timeout)
    return proc, out, time.perf_counter() - t0


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("spec", ["exactrl.tasks.arithmetic:reward", "exactrl.rewards.mathverify:reward",
                                  pytest.param("server", marks=pytest.mark.slow)])
def test_every_shipped_reward_trains_and_evaluates(files, spec):
    server = None
    if spec == "server":  # the reference server, serving math-verify from its request threads
        server = make_server("exactrl.rewards.mathverify:reward", port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        spec = f"http://127.0.0.1:{server.server_port}/"
    try:
        proc, run, _ = rl(files, f"shipped-{abs(hash(spec))}", f"reward.fn={spec}", f"data.eval={files['eval']}")
    finally:
        if server is not None:
            server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["reward_failures"] == 0 for r in steps)
    (final_eval,) = [r for r in rows if "eval_accuracy" in r]
    assert 0.0 <= final_eval["eval_accuracy"] <= 1.0
    assert (run / "final" / "model.safetensors").exists()


def test_evaluation_scores_with_the_runs_reward_and_only_on_data_it_is_given(files):
    proc, run, _ = rl(files, "eval-own-reward", "reward.fn=reward_fixtures:one", f"data.eval={files['eval']}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The run's reward gives every answer 1; the built-in checker would have scored this random model 0.
    assert [r["eval_accuracy"] for r in metrics(run) if "eval_accuracy" in r] == [1.0]
    proc, run, _ = rl(files, "eval-default", "reward.fn=reward_fixtures:one", "data.eval=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: no evaluation" in proc.stdout and not [r for r in metrics(run) if "eval_accuracy" in r]


def test_rows_without_the_answer_the_reward_needs_are_named(files):
    proc, run, _ = rl(files, "no-answer", f"data.train={files['no_answer']}")
    assert proc.returncode == 2
    assert f"{files['no_answer']}:1: no 'answer', which reward.fn 'exactrl.tasks.arithmetic:reward'" in proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()
    proc, _, _ = rl(files, "no-eval-answer", f"data.eval={files['no_answer']}")
    assert proc.returncode == 2 and f"{files['no_answer']}:1: no 'answer', which the evaluation reward" in proc.stderr
    proc, run, _ = rl(files, "needs-none", f"data.train={files['no_answer']}", "reward.fn=reward_fixtures:varied")
    assert proc.returncode == 0, proc.stderr[-3000:]  # varied.needs_answer = False


# The exits and crashes are checked on the reward path alone in tests/test_reward_isolation.py; here under `slow`.
@pytest.mark.parametrize("spec, says", [("reward_fixtures:hangs", "no result within reward.timeout=3s"),
                                        pytest.param("reward_fixtures:exits", "the reward called sys.exit(0)",
                                                     marks=pytest.mark.slow),
                                        pytest.param("reward_fixtures:os_exits", "the reward process died (exit code 0",
                                                     marks=pytest.mark.slow)])
def test_a_hung_or_exiting_reward_ends_the_run_with_an_error(files, spec, says):
    proc, run, seconds = rl(files, f"fail-{spec.split(':')[1]}", f"reward.fn={spec}", "reward.timeout=3", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: reward function '{spec}' failed on the batch of 8 samples" in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "final").exists()
    assert seconds < 60  # the process ends: no thread left behind to join


@pytest.mark.slow
def test_a_raising_reward_names_the_sample(files):
    proc, _, _ = rl(files, "raises", f"data.train={files['bad']}", "reward.fn=reward_fixtures:raises_on_bad_prompt")
    assert proc.returncode == 2
    assert f"failed on sample {files['bad']}:2 with ValueError: this prompt is bad" in proc.stderr


@pytest.mark.slow
def test_a_hung_reward_with_fallback_costs_one_timeout_per_rollout(files):
    # 2 rollouts of 8 samples: one timeout each (~2 x 2 s), where a timeout per sample took 2 x 8 x 2 s.
    proc, run, seconds = rl(files, "fallback", "reward.fn=reward_fixtures:hangs", "reward.timeout=2",
                            "reward.fallback=-1.0",
                            timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in metrics(run) if "loss" in r]
    assert [(r["reward_failures"], r["reward_mean"]) for r in steps] == [(8, -1.0), (8, -1.0)]
    fast, _, base = rl(files, "fallback-baseline", "reward.fn=reward_fixtures:one")
    assert fast.returncode == 0
    # two timeouts and two fresh reward processes, with room; per sample would be 32 s
    assert seconds - base < 2 * (2 + 3)


def test_a_failing_final_evaluation_keeps_the_trained_model(files):
    proc, run, _ = rl(files, "eval-fails", f"data.eval={files['eval']}", "eval.reward_fn=reward_fixtures:exits")
    assert proc.returncode == 1 and "the final evaluation failed" in proc.stderr and "Traceback" not in proc.stderr
    assert (run / "final" / "model.safetensors").exists() and f"saved in {run / 'final'}" in proc.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2]


def test_evaluation_answers_that_got_the_fallback_are_counted(files):
    proc, run, _ = rl(files, "eval-fallback", f"data.eval={files['eval']}", "eval.reward_fn=reward_fixtures:exits",
                      "reward.fallback=0.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (final_eval,) = [r for r in metrics(run) if "eval_accuracy" in r]
    assert final_eval["eval_reward_failures"] == 2 and final_eval["eval_accuracy"] == 0.0
    assert "(2 scored reward.fallback: the reward failed on them)" in proc.stdout + proc.stderr


def test_sft_needs_a_scorer_for_its_own_eval_file():
    with pytest.raises(ConfigError, match="data.eval=mine.jsonl needs eval.reward_fn=module:function"):
        load_config(SFTConfig, None, ["data.eval=mine.jsonl"])
    assert load_config(SFTConfig, None, ["data.eval=mine.jsonl", "eval.reward_fn=m:f"]).eval.reward_fn == "m:f"
    assert load_config(SFTConfig, None, []).data.eval == "auto"
