"""Resume exactness on the distributed backends, through the real command line: stop after
step 2 of 4, resume from the checkpoint, and reach the uninterrupted run's final parameters
(relative error <= 1e-6; measured bitwise) -- FSDP2 and DeepSpeed ZeRO-2 with CPU-offloaded
optimizer and ZeRO-3, at world size 2 (gloo, CPU). AdamW with weight decay and a warm-up +
cosine schedule, so optimizer moments, the schedule's position, the data position and every
rank's RNG must all come back. (The single backend: tests/test_resume.py, bitwise.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from old_deepspeed import ds_env
from own_audit import assert_verdicts

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--config", "examples/sft_tiny.yaml", "data.eval=null", "train.max_steps=4", "train.global_batch_size=16",
          "train.micro_batch_size=4", "optim.warmup_steps=2", "optim.weight_decay=0.1", "optim.lr=1e-2"]


def sft(tmp_path, *overrides, expect: int = 0) -> str:
    env = {**os.environ, "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           **(ds_env() if any("deepspeed" in o for o in overrides) else {})}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "sft", *COMMON, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == expect, (proc.stdout + proc.stderr)[-4000:]
    return " ".join((proc.stdout + proc.stderr).split())


def rel_err(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    num = sum(((wa[k].double() - wb[k].double()).norm() ** 2).item() for k in wa)
    return (num / sum((wb[k].double().norm() ** 2).item() for k in wb)) ** 0.5


LAYOUTS = {
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero2-offload": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
    "zero3": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"],
}


# ZeRO-3 under `slow` (~60 s): tests/test_rl_distributed.py resumes a ZeRO-3 run exactly in CI
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if name == "zero3" else [])
                                    for name in LAYOUTS])
def test_resume_reaches_the_uninterrupted_run(tmp_path, layout):
    if layout != "fsdp2":
        pytest.importorskip("deepspeed")
    extra = [*LAYOUTS[layout], "distributed.nproc_per_node=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    sft(tmp_path, *extra, "train.save_every=2", f"output_dir={full}")
    # the audit reads what ran: 2 processes (the manifest's world size), K = 16 / (4 x 2)
    engine = {"fsdp": ["FSDP2 (distributed.backend=fsdp2)"]} if layout == "fsdp2" else {
        "zero_stage": [int(LAYOUTS[layout][1][-1])], "offload_optimizer": ["cpu" if "offload" in layout else "none"]}
    assert_verdicts(full, facts={"world_size": [2], "effective_k": [2], **engine})
    checkpoint = full / "checkpoint-2"
    assert (checkpoint / "rng-rank0.pt").is_file() and (checkpoint / "rng-rank1.pt").is_file()
    sft(tmp_path, *extra, f"train.resume_from={checkpoint}", f"output_dir={resumed}")
    err = rel_err(resumed / "final", full / "final")
    print(f"{layout}: resumed vs uninterrupted, relative error {err:.3g}")
    assert err <= 1e-6
    assert rel_err(checkpoint, full / "final") > 1e-3  # the resumed run really had steps 3 and 4 left to take
    if layout == "fsdp2":  # another number of processes is refused before anything is written
        out = sft(tmp_path, *LAYOUTS[layout], f"train.resume_from={checkpoint}", f"output_dir={tmp_path / 'r1'}",
                  expect=2)
        assert "was written by 2 processes; this run has 1" in out and not (tmp_path / "r1").exists()
