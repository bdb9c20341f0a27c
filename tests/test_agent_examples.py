"""The agent examples as a user runs them (`exactrl rl --config examples/agent_*.yaml`), shortened to one rollout and
started from the calculator task's initial model (its SFT model takes ~15 min to build): on the HF decode loop in
CI; under Ray and with the real vLLM engine, and PPO's, in the slow suite. Each run's episodes pass the trajectory
check (the run stops otherwise), the on-policy check and the canary; the tool environment answers in its own
process. What the examples reach when trained as written: docs/algorithms/agents.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["model.path=builtin", "train.max_steps=1", "train.global_batch_size=8", "train.micro_batch_size=4",
         "algo.group_size=4", "data.eval_size=8", "train.eval_every=0", "rollout.max_new_tokens=24",
         "eval.max_new_tokens=24", "env.max_tokens=64"]


def exactrl_rl(config: str, run: Path, *extra: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "rl", "--config", config, *SHORT, *extra,
                           f"output_dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exactrl rl --config {config} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def check_episode_step(rows: list[dict]) -> None:
    step = next(r for r in rows if "reward_mean" in r)
    assert step["canary"] == 1.0 and step["ratio_dev_first"] is not None and step["ratio_dev_first"] <= 1e-5
    assert step["env/errors"] == 0 and step["env/turns"] >= 1.0 and step["sync_probe_error"] < 1e-5
    assert all(v < 1e-4 for k, v in step.items() if k.startswith("rollout_gap/turn_"))
    final = next(r for r in rows if "eval_accuracy" in r)
    assert "eval_env/tool_call_rate" in final  # the evaluation ran whole episodes


def test_the_tool_example_runs_on_the_decode_loop(tmp_path):
    check_episode_step(exactrl_rl("examples/agent_tools.yaml", tmp_path / "hf"))


@pytest.mark.slow
def test_the_tool_example_runs_under_ray(tmp_path):
    check_episode_step(exactrl_rl("examples/agent_tools.yaml", tmp_path / "ray", "ray.enabled=true",
                                  "ray.placement=split", "ray.ranks=1", "ray.engines=1"))


@pytest.mark.slow
def test_the_tool_example_runs_with_the_real_vllm_engine(tmp_path):
    if not (ROOT / ".venv-vllm" / ".installed").exists():
        subprocess.run(["make", "-s", "vllm"], cwd=ROOT, check=True)
    check_episode_step(exactrl_rl("examples/agent_tools.yaml", tmp_path / "vllm", "rollout.engine=vllm",
                                  f"rollout.vllm.python={ROOT / '.venv-vllm' / 'bin' / 'python'}",
                                  "rollout.vllm.cpu_kv_cache_gb=1"))


@pytest.mark.slow
def test_the_ppo_example_runs(tmp_path):
    rows = exactrl_rl("examples/agent_ppo.yaml", tmp_path / "ppo", "train.max_steps=4", "critic.warmup_rollouts=0")
    check_episode_step(rows)
