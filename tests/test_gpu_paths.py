"""scripts/gpu_paths.py, the GPU session's first script, runs on the CPU at tiny sizes: every path
it times is the one a run takes, and each agrees with its reference (on a GPU the same script
reports the kernels' speed and bf16 differences)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_paths_script_runs_every_path_on_the_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_paths.py"), "--device", "cpu", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["path"]: r for r in (json.loads(line[5:]) for line in out.stdout.splitlines()
                                   if line.startswith("PATH "))}
    assert "error" not in rows, rows.get("error")
    assert json.loads((tmp_path / "gpu-paths.json").read_text()) == list(rows.values())
    # the gather path; torch's varlen_attn cannot run on the CPU, so that row is the gather path again
    assert rows["packed gather"]["ran"] == rows["packed torch_varlen"]["ran"] == ["sdpa varlen"]
    assert rows["packed torch_varlen"]["max_abs_logprob"] == 0
    assert rows["packed flex"]["ran"] == ["flex varlen"]
    assert rows["packed flex"]["max_abs_logprob"] < 1e-5 and rows["packed flex"]["grad_rel"] < 1e-5
    chunked = rows["head chunk=64"]
    assert 0 <= chunked["max_abs_logprob"] < 1e-5 and chunked["grad_rel"] < 1e-5
    assert rows["decode graphs"]["same_tokens"] and rows["decode graphs"]["max_abs_logprob"] < 1e-5
    assert rows["decode eager"]["tokens_per_s"] > 0 and rows["decode graphs"]["tokens_per_s"] > 0
