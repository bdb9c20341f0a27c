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
    # what one machine cannot check is named, with the reason, not left out of a PASS
    skips = [line.split() for line in out.splitlines() if " SKIP " in line]
    assert [s[0] for s in skips] == ["test_fsdp2_world_two_over_nccl_applies_the_full_batch_update", "world", "ray"]
    assert all("needs" in s for s in skips), skips


def gpu_check_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_a_failing_run_is_a_fail_row(tmp_path):
    row = gpu_check_module().run_training("sft", "fp32", 1, True, -1, tmp_path)  # max_steps=-1: the config refuses it
    assert row[1] == "FAIL" and "exit code" in row[2]


def test_a_gpu_users_environment_without_ray_skips_the_ray_rows(monkeypatch, tmp_path):
    """make gpu-check PY=python in an environment installed without the ray extra: SKIP with the reason, not FAIL."""
    gpu_check = gpu_check_module()
    find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "ray" else find_spec(name))
    row = gpu_check.run_training("ray", "fp32", 1, True, 1, tmp_path)
    assert row[1] == "SKIP" and "Ray is not installed" in row[2], row


def test_the_gpu_tests_measure_the_update_where_the_engine_placed_the_model(monkeypatch, tokenizer, make_model):
    """On the CPU no engine moves a model, so the dry run cannot see a GPU test that keeps tensors from before the
    engine placed the model (tests/test_gpu.py cloned the parameters first: on the GPU that was a device error, and
    exactrl's first GPU run reported FAIL). Here the engine's placement gives every parameter new storage holding other
    values (each shifted by 1), so a helper mixing tensors from before and after the placement measures the shift, not
    the update: test_gpu's micro-batch test must still hold its bound."""
    import torch

    import exactrl.distributed.engine as engine_module
    import test_gpu

    placed = engine_module.place

    def place_elsewhere(model, device):
        placed(model, device)
        for p in model.parameters():
            p.data = p.data + 1.0
        return model

    monkeypatch.setattr(engine_module, "place", place_elsewhere)
    monkeypatch.setattr(test_gpu, "place", place_elsewhere)
    figures = []
    for micro in (8, 2):
        test_gpu.test_fp32_micro_batches_match_the_full_batch_on_the_device(
            tokenizer, make_model, torch.device("cpu"), lambda name, value: figures.append(value), micro)
    assert len(figures) == 2 and max(figures) <= 1e-5
