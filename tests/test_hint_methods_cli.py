"""UFT and Prefix-RFT through the command line, from their example configs: the logged hint / prefix
schedule, the prefixed responses per group, and every step exact (canary 1) and on-policy at its first
update."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_cli(args, cwd, cache):
    env = {**os.environ, "EXACTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"exactrl {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [r for r in map(json.loads, open(Path(cwd) / "run" / "metrics.jsonl")) if "loss" in r]


SHORT = ["model.path=builtin", "data.eval=null", "train.max_steps=3", "train.log_every=1", "train.global_batch_size=8",
         "train.micro_batch_size=4", "algo.group_size=4", "rollout.max_new_tokens=6", "output_dir=run"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_uft_runs_from_its_example_with_the_hint_share_on_its_schedule(tmp_path, cache):
    """Three rollouts with hint_steps=1: the logged share is the paper's cosine, 0.95 then 0.05,
    then no hint at all; every step exact (canary 1) and on-policy at its first update."""
    rows = run_cli(["rl", "--config", str(EXAMPLES / "uft.yaml"), *SHORT, "algo.uft.hint_steps=1"], tmp_path, cache)
    expect = [0.05 + 0.9 * (1 + math.cos(math.pi * t)) / 2 for t in (0, 1)] + [0.0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["hint_level"] for r in rows] == pytest.approx(expect, abs=1e-12)
    assert rows[0]["hinted"] == 1.0 and rows[0]["hint_tokens"] > 0  # at p = 0.95 every prompt has a hint
    assert rows[2]["hinted"] == 0.0 and rows[2]["hint_tokens"] == 0.0
    assert all(r["canary"] == 1.0 and r["ratio_dev_first"] == 0.0 for r in rows)


def test_prefix_rft_runs_from_its_example_with_one_prefixed_response_per_group(tmp_path, cache):
    """decay_steps=2: the prefix share's lower bound follows the cosine 0.95, 0.5, 0.05; exactly one
    response of each group of 4 continues a prefix; about a fifth of the prefix tokens train."""
    rows = run_cli(["rl", "--config", str(EXAMPLES / "prefix_rft.yaml"), *SHORT, "algo.prefix_rft.decay_steps=2"],
                   tmp_path, cache)
    assert [r["hint_level"] for r in rows] == pytest.approx([0.95, 0.5, 0.05], abs=1e-12)
    # int(l x length) tokens, l >= 0.5 in the first two rollouts; at l < 0.1 a 10-token demonstration gets none
    assert [r["hinted"] for r in rows[:2]] == [0.25, 0.25] and rows[2]["hinted"] <= 0.25
    # each prefix keeps n - int(0.8 n) of its n tokens: 1 of a 1-token prefix, 2 of 9 (rollout 0: n >= 9)
    assert 0.2 <= rows[0]["prefix_kept"] <= 1 / 3 and all(0 < r["prefix_kept"] <= 1 for r in rows)
    assert all(r["canary"] == 1.0 and r["ratio_dev_first"] == 0.0 for r in rows)
