"""The canary stops a real `exactrl sft` run on the real bug: DeepSpeed 0.18.5 (affected range
0.15.2-0.18.9) with ZeRO-2, offload_optimizer=cpu and K >= 3 loses intermediate micro-batch
gradients in the CPU-offloaded fp32 partition; the canary reads the gradient there, before
the optimizer applies it. On the same stack K = 2 is exact, so the run trains through.

Runs in the throw-away DeepSpeed 0.18.5 environment of tests/old_deepspeed.py, with this
checkout on PYTHONPATH, through the real command line.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from old_deepspeed import ROOT, VERSION, ds_env, old_deepspeed_python
from own_audit import DS, A, assert_verdicts

ZERO2_CPU = ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]


def sft_on_old_deepspeed(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           **ds_env(VERSION)}
    args = ["sft", "--config", "examples/sft_tiny.yaml", *ZERO2_CPU, f"output_dir={tmp_path / 'runs'}",
            "train.max_steps=2",
            "train.micro_batch_size=8", "data.eval_size=8", "train.eval_every=0", *overrides]
    return subprocess.run([old_deepspeed_python(), "-m", "exactrl.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("k", [3, pytest.param(4, marks=pytest.mark.slow)])  # K=4: ~17 s more of the same path
def test_canary_stops_the_run_before_the_corrupted_step(tmp_path, k):
    proc = sft_on_old_deepspeed(tmp_path, f"train.global_batch_size={8 * k}")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 3, out[-3000:]
    assert "stopped by the canary: canary failed at optimizer step 0" in out
    assert f"ZeRO stage 2, offload_optimizer cpu, K={k}, world size 1, deepspeed {VERSION}" in out
    value = float(out.split("carries ")[1].split(" ")[0])
    assert value < 0.9  # intermediate micro-batches lost: only part of the step's loss arrived
    assert (tmp_path / "runs" / "config.yaml").is_file()  # the run got as far as training...
    assert not (tmp_path / "runs" / "final").exists()  # ...and saved nothing trained on a corrupted gradient
    # the audit: the stack was in the bug's range, and the canary stopped the run at its first corrupted step
    assert_verdicts(tmp_path / "runs", ds=A, facts={"version:deepspeed": [f"=={VERSION}"], "effective_k": [k]},
                    says={DS: (f"With deepspeed {VERSION}, ZeRO stage 2, offload_optimizer cpu and K = {k}",
                               "The canary stopped the run before applying a step")})


def test_same_stack_with_k2_trains_and_reads_exactly_one(tmp_path):
    proc = sft_on_old_deepspeed(tmp_path, "train.global_batch_size=16", "train.log_every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs"
    assert (run / "final" / "model.safetensors").is_file()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(abs(s["canary"] - 1.0) <= 1e-5 and s["micro_batches"] == 2 for s in steps)
    assert json.loads((run / "manifest.json").read_text())["versions"]["deepspeed"] == VERSION
    assert_verdicts(run, facts={"version:deepspeed": [f"=={VERSION}"], "zero_stage": [2], "effective_k": [2]},
                    says={DS: "K = 2 is accidentally right"})
