"""`exactrl rl` on two processes, through the real command line: FSDP2 with PPO (critic,
reference model and KL), DeepSpeed ZeRO-3 with DAPO (dynamic sampling), DeepSpeed ZeRO-2 with
CPU-offloaded optimizer and REINFORCE++ -- each with the canary on. Each run stops after
rollout 2 of 4 and resumes from the checkpoint; the resumed run must reach the uninterrupted
run's final policy (and critic) exactly: rollouts are sampled from streams keyed by (seed,
rollout, prompt, sample), shared, scored and turned into advantages identically, so any
difference would show. (The same run on other layouts: tests/test_rl_layout.py.)
(The one-process loop: tests/test_rl.py and tests/test_resume.py; the losses on every
backend against a reference: tests/test_rl_backends.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exactrl.config.methods import names
from exactrl.tasks.builtin import BuiltinSpec
from old_deepspeed import ds_env
from test_resume_distributed import rel_err

ROOT = Path(__file__).resolve().parents[1]
# The built-in task's untrained model: its answers are wrong, so the reward is the length
# of the response mod 3 (varied within groups, so every algorithm has advantages to follow).
COMMON = ["--config", "examples/grpo_tiny.yaml", "model.path=builtin", "data.eval=null", "train.max_steps=4",
          "train.global_batch_size=16", "train.micro_batch_size=4", "algo.group_size=4", "rollout.max_new_tokens=8",
          "train.log_every=1", "optim.warmup_steps=1", "optim.lr=1e-3", "reward.fn=length_reward:reward",
          "distributed.nproc_per_node=2"]
LAYOUTS = {
    "fsdp2-ppo": ["distributed.backend=fsdp2", "algo.name=ppo", "algo.kl_coef=0.05", "algo.kl_in_reward=true",
                  "critic.warmup_rollouts=1"],
    "zero3-dapo": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3", "algo.name=dapo",
                   "algo.clip_eps_high=0.28"],
    "zero2-offload-reinforce_pp": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2",
                                   "deepspeed.offload_optimizer=cpu",
                                   "algo.name=reinforce_pp", "algo.group_size=1", "algo.kl_coef=0.05"],
}


def rl(tmp_path, *overrides):
    (tmp_path / "length_reward.py").write_text("def reward(prompts, completions, answers):\n"
                                              "    return [float(len(c) % 3) for c in completions]\n")
    env = {**os.environ, "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path),
           **(ds_env() if any("deepspeed" in o for o in overrides) else {})}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "rl", *COMMON, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


# ZeRO-2 + CPU offload under `slow` (~50 s): in CI tests/test_resume_distributed.py resumes it exactly and
# tests/test_rl_backends.py holds every RL loss on it to the one-pass reference
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if "offload" in name else [])
                                    for name in LAYOUTS])
def test_distributed_rl_runs_with_the_canary_and_resumes_exactly(tmp_path, layout):
    if "zero" in layout:
        pytest.importorskip("deepspeed")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rl(tmp_path, *LAYOUTS[layout], "train.save_every=2", f"output_dir={full}")
    steps = [r for r in map(json.loads, open(full / "metrics.jsonl")) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        # The whole rollout on every rank's books; each rank trained on half of it, checked.
        assert r["rollout_responses"] == 16 and r["responses"] == 16
        if r.get("canary") is not None:
            assert r["samples"] == 8 and abs(r["canary"] - 1) <= 1e-5
        assert r.get("ratio_dev_first") in (None, 0.0) or r["ratio_dev_first"] <= 1e-6
        # the rollout-trainer gap, over the old-log-prob pass or (dapo: one update) reduced over both ranks' forwards
        assert r["rollout_gap/abs_max"] <= 1e-4 and r["rollout_gap/outside_frac"] == 0.0
    if layout.startswith("fsdp2-ppo"):
        assert steps[0].get("canary") is None and abs(steps[0]["critic_canary"] - 1) <= 1e-5  # warm-up: only the critic
        assert all(abs(r["critic_canary"] - 1) <= 1e-5 for r in steps)
    if "dapo" in layout:
        assert all("groups_dropped" in r for r in steps)

    checkpoint = full / "checkpoint-2"
    rl(tmp_path, *LAYOUTS[layout], f"train.resume_from={checkpoint}", f"output_dir={resumed}")
    err = rel_err(resumed / "final", full / "final")
    print(f"{layout}: resumed vs uninterrupted, relative error {err:.3g}")
    assert err <= 1e-6
    assert rel_err(checkpoint, full / "final") > 1e-4  # rollouts 3 and 4 really changed the policy
    if "ppo" in layout:
        assert rel_err(resumed / "final-critic", full / "final-critic") <= 1e-6
        assert rel_err(checkpoint / "critic", full / "final-critic") > 1e-4


ALGOS = names(demonstrations=False, policy_term=True)  # on_policy_distill: tests/test_on_policy_distill.py
MATRIX = {
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero0": ["distributed.backend=deepspeed", "deepspeed.zero_stage=0"],
    "zero1-offload": ["distributed.backend=deepspeed", "deepspeed.zero_stage=1", "deepspeed.offload_optimizer=cpu"],
    "zero2-offload": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
    "zero3": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"],
    "zero3-offload-all": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
                          "deepspeed.offload_param=cpu"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", MATRIX)
@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_on_every_layout_at_world_two(tmp_path, algo, layout):
    """The whole matrix (slow: ~50 launches): two steps of each algorithm, canary on, ratio 1
    at each rollout's first update, the policy moved."""
    if "zero" in layout:
        pytest.importorskip("deepspeed")
    rl(tmp_path, *MATRIX[layout], f"algo.name={algo}", "train.max_steps=2", "algo.kl_coef=0.05",
       f"algo.group_size={1 if algo == 'reinforce_pp' else 4}", f"output_dir={tmp_path / 'run'}")
    steps = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(abs(r["canary"] - 1) <= 1e-5 and r["ratio_dev_first"] <= 1e-6 for r in steps)
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    before = load_file(tmp_path / "cache" / BuiltinSpec().key() / "model-init" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
