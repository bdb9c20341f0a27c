"""LUFFY and SRFT end to end through the CLI on the built-in task's mixed file (the SFT problems
with their demonstrations): the groups hold the policy's samples and a demonstration, the
demonstrations' tokens enter the loss, and the logged per-term metrics agree with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEP = ["model.path=builtin", "data.train=builtin", "data.eval=null", "train.global_batch_size=8",
        "train.micro_batch_size=2", "algo.group_size=4", "train.max_steps=2", "train.log_every=1",
        "rollout.max_new_tokens=8", "optim.lr=1e-3"]


def run(tmp_path, cache, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "EXACTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "exactrl.cli", "rl", *args, f"output_dir={tmp_path / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=600)


# srft under `slow` (~17 s): the same mixed rollout and CLI path as luffy; its loss is held to the one-pass
# reference on every backend in tests/test_rl_backends.py
@pytest.mark.parametrize("algo", ["luffy", pytest.param("srft", marks=pytest.mark.slow)])
def test_mixed_policy_method_trains_through_the_cli(algo, tmp_path, cli_cache):
    proc = run(tmp_path, cli_cache, f"algo.name={algo}", *STEP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # 2 prompts x (3 sampled + 1 demonstration): responses and the rollout statistics count the policy's samples
        assert (r["responses"], r["rollout_prompts"], r["rollout_responses"], r["canary"]) == (6, 2, 6, 1.0)
        # the loss counts every generated token and the demonstrations' (the built-in ones are correct)
        assert r["loss_tokens"] > r["generated_tokens"] and r["demo_reward_mean"] == 1.0
        assert 0.0 < r["demo_prob"] < 1.0
        if algo == "luffy":
            # the on-policy check ran over the policy's tokens only: a demonstration's ratio p is far from 1
            assert r["ratio_dev_first"] < 1e-2 and 0.0 <= r["clip_frac"] <= 1.0
        else:
            assert r["ratio_dev_first"] is None  # srft takes no ratio
            assert r["positive_fraction"] + r["negative_fraction"] == pytest.approx(1.0)

