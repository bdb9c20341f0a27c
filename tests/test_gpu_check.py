"""make gpu-check's script runs on the CPU (--dry-run) and passes here; a run that fails is a
FAIL row and a nonzero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"


def test_dry_run_passes_and_prints_the_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--steps", "1", "--runs",
                           "sft-bf16,ray-fp32"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "gpu-check: PASS" in out and "tests -m gpu" in out and "rel_err = " in out and "packed_error = " in out
    assert "sft bf16 world 1" in out and "tokens/s" in out  # grpo-<dtype> is the ray run's loop without Ray
    ray_row = next(line for line in out.splitlines() if line.startswith("ray fp32 world 1"))
    assert "PASS" in ray_row and "sync probe " in ray_row and "rollout gap " in ray_row, ray_row


def test_a_failing_run_is_a_fail_row(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    row = gpu_check.run_training("sft", "fp32", 1, True, -1, tmp_path)  # max_steps=-1: the config refuses it
    assert row[1] == "FAIL" and "exit code" in row[2]
