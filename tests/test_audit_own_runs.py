"""`exactrl audit run` on exactrl's own run directories that no other test makes (slow: real runs):
DeepSpeed 0.18.5 in the bug's range with the canary told to warn, switched off, or checking a stack
the files no longer say, and ReLIFT's own mean of micro-batch means chosen for its SFT steps. The
other kinds are audited by the tests that make them: sft and rl (test_e2e.py), a pipeline
(test_pipeline.py), the faults and the demo (test_faults.py), Ray (test_ray.py), FSDP2 and DeepSpeed
at world size 2 (test_resume_distributed.py), DeepSpeed 0.18.5's real bug stopped by the canary
(test_canary_real_bug.py), a study with a cell of both faults and an `exactrl eval` run
(test_study_cli.py); tests/own_audit.py holds the checks they share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from old_deepspeed import ROOT, VERSION, ds_env, old_deepspeed_python
from own_audit import DS, ORLHF, A, assert_verdicts


def old_sft(tmp_path: Path, name: str, k: int, *overrides: str) -> Path:
    """`exactrl sft` on DeepSpeed 0.18.5, ZeRO-2 unless overridden, K micro-batches of 8 per step."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           **ds_env(VERSION)}
    out = tmp_path / name
    proc = subprocess.run([old_deepspeed_python(), "-m", "exactrl.cli", "sft", "--config", "examples/sft_tiny.yaml",
                           "distributed.backend=deepspeed", "deepspeed.offload_optimizer=cpu", f"output_dir={out}",
                           "train.max_steps=2", "train.micro_batch_size=8", f"train.global_batch_size={8 * k}",
                           "data.eval_size=8", "train.eval_every=0", "train.log_every=1", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow  # ~1 min: three runs on DeepSpeed 0.18.5; its canary stopping the bug is test_canary_real_bug.py's
def test_deepspeed_in_the_bugs_range_is_judged_by_what_the_canary_saw(tmp_path):
    stack = f"With deepspeed {VERSION}, ZeRO stage 2, offload_optimizer cpu and K = 3"
    # warn: the run trained on through the corrupted steps, which the canary counted
    warned = old_sft(tmp_path, "warn", 3, "audit.canary=warn")
    assert_verdicts(warned, ds=A, says={DS: (stack, "The canary (audit.canary=warn) flagged 2 step(s)")})
    # off: nothing checked the steps: the stack alone decides
    unchecked = old_sft(tmp_path, "off", 3, "audit.canary=off")
    assert_verdicts(unchecked, ds=A, says={DS: (stack, "audit.canary=off: nothing checked")})
    # the user's DeepSpeed JSON set ZeRO-1 (exact with offload): read, it decides; gone, the canary's readings do
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    checked = old_sft(tmp_path, "zero1", 3, f"deepspeed.config={user}")
    assert_verdicts(checked, facts={"zero_stage": [1], "effective_k": [3]}, says={DS: "ZeRO stage 1 + offload"})
    user.unlink()
    assert_verdicts(checked, facts={"zero_stage": []}, says={DS: ("names deepspeed.config", "But: The canary "
                                                                  "(audit.canary=error) read the gradient of every")})


@pytest.mark.slow  # ~20 s: no other test runs ReLIFT's own normalisation through the command line
def test_relifts_own_mean_of_means_chosen_for_its_sft_steps_is_affected(tmp_path):
    out = tmp_path / "relift"
    env = {**os.environ, "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "rl", "--config", "examples/relift.yaml",
                           "model.path=builtin", "algo.relift.mean_of_means=true", "algo.relift.buffer_size=4",
                           "train.global_batch_size=16", "train.micro_batch_size=2", "algo.group_size=4",
                           "train.max_steps=2", "rollout.max_new_tokens=8", "data.eval=null", "train.log_every=1",
                           f"output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any('"sft_loss"' in line for line in (out / "metrics.jsonl").read_text().splitlines())  # an SFT step ran
    assert_verdicts(out, orlhf=A, facts={"trainer": ["rl (relift)"]},
                    says={ORLHF: "algo.relift.mean_of_means=true"})
