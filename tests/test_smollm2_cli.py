"""`exactrl sft` and `exactrl rl` through the command line on SmolLM2-135M-Instruct with the
example configs (examples/smollm2_*.yaml), a couple of steps each: the runs finish with the
canary and the on-policy check passing, SFT's loss falls on a batch it sees twice, GRPO scores
with the math reward, and the saved model keeps its chat template."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def exactrl(args):
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"exactrl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def metrics(run: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, open(run / "metrics.jsonl")) if key in r]


def test_sft_two_steps_on_chats(smollm2_dir, tmp_path):
    """The step's batch is the whole 4-chat file, so the second step sees the same chats and its
    loss must be lower."""
    chats = (ROOT / "examples" / "data" / "math_chat_sft.jsonl").read_text().splitlines()[:4]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(chats) + "\n")
    run = tmp_path / "sft"
    exactrl(["sft", "--config", "examples/smollm2_sft.yaml", f"model.path={smollm2_dir}", f"data.train={data}",
             "data.eval=null", "train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
             "optim.warmup_steps=0", "optim.scheduler=constant", f"output_dir={run}"])
    steps = metrics(run, "loss")
    assert [(r["step"], r["micro_batches"], r["samples"], r["canary"]) for r in steps] == [(1, 2, 4, 1.0),
                                                                                          (2, 2, 4, 1.0)]
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[1]["loss"] < steps[0]["loss"]
    assert AutoTokenizer.from_pretrained(run / "final").chat_template  # the trained model still chats


def test_grpo_one_step_with_the_math_reward(smollm2_dir, tmp_path):
    run = tmp_path / "rl"
    exactrl(["rl", "--config", "examples/smollm2_grpo.yaml", f"model.path={smollm2_dir}", "data.eval=null",
             "train.max_steps=1", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
             "rollout.max_new_tokens=48", f"output_dir={run}"])
    (step,) = metrics(run, "reward_mean")
    assert step["samples"] == 8 and step["canary"] == 1.0
    # The on-policy check ran (a one-update rollout is checked against the generator) and passed.
    assert step["ratio_dev_first"] is not None and step["ratio_dev_first"] <= 1e-2
    assert 0.0 <= step["reward_mean"] <= 1.0 and step.get("reward_failures", 0) == 0
    assert (run / "final" / "model.safetensors").exists()


def test_grpo_one_step_with_a_tool_through_the_chat_template(smollm2_dir, tmp_path):
    """examples/smollm2_tools.yaml: episodes through SmolLM2's own ChatML template (append-only: no notice), the
    trajectory check passing on every rollout, observations never in the loss, the on-policy check passing."""
    run = tmp_path / "tools"
    proc = exactrl(["rl", "--config", "examples/smollm2_tools.yaml", f"model.path={smollm2_dir}", "data.eval=null",
                    "train.max_steps=1", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
                    "rollout.max_new_tokens=40", f"output_dir={run}"])
    assert "not an extension" not in proc.stdout + proc.stderr  # the template check found ChatML append-only
    (step,) = metrics(run, "reward_mean")
    assert step["samples"] == 8 and step["canary"] == 1.0
    assert step["ratio_dev_first"] is not None and step["ratio_dev_first"] <= 1e-2
    assert step["env/errors"] == 0 and step["env/turns"] >= 1.0
    # a turn closed by <|im_end|> gets only the template's '\n'; the policy's tokens are all that is trained
    assert step["loss_tokens"] == pytest.approx(8 * step["env/policy_tokens"])
    assert step["rollout_gap/turn_0_max"] <= 1e-3
