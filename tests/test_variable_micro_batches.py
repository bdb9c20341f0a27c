"""Steps with different micro-batch counts (1, 3, 4, 2 per rank, as mixed-policy methods give them)
stay exact on every engine at world size 1 and 2 (tests/dist/variable_micro.py): the plan's count,
given to ``engine.begin_step``, places DeepSpeed's accumulation boundary, not the configured
gradient_accumulation_steps (2 here). Before that, ZeRO 1-3 applied an update off by 48-89% of
it with the canary off, and the canary stopped step 0 ("carries 0 ... over 1 micro-batches").

Fast: FSDP2 and DeepSpeed ZeRO-2 + offload_optimizer cpu, ZeRO-1 + offload, ZeRO-3 + offload of
the optimizer and parameters. Slow: the single engine, every stage x offload, and nominal
accumulation steps 1, 2 and 4; and DeepSpeed 0.18.5, whose offload bug follows each step's count.

fp32 throughout; the bound, 1e-6 of the update, leaves room for the summation order alone (a
micro-batch's squared errors summed apart from the others, measured ~2e-7), while a misplaced
boundary moves the update by tens of percent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from distributed_harness import run_cases
from old_deepspeed import ds_env

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is part of the test environment (requirements.txt)")

SCRIPT = Path(__file__).parent / "dist" / "variable_micro.py"
TOL = 1e-6


def check(r: dict, world: int) -> None:
    assert r["cases"]
    for c in r["cases"]:
        assert c["micro_batches"] == [1, 3, 4, 2], c
        assert all(abs(v - 1.0) <= 1e-5 for v in c["canary"]), c
        assert c["rel_err"] <= TOL, c
    if world == 2:  # unequal counts are refused on every rank before a backward could wait for a peer
        assert set(r["unequal"]) == {"fsdp2", "deepspeed"}
        for message in r["unequal"].values():
            assert "the plan gives the ranks different numbers of micro-batches (from 1 to 2" in message, message


@pytest.mark.parametrize("world", [1, 2])
def test_steps_with_different_micro_batch_counts_apply_the_full_batch_update(world, tmp_path):
    r = run_cases("ci", world, tmp_path / "results.json", ds_env(), script=SCRIPT)
    assert {c["config"] for c in r["cases"]} == {"", "deepspeed.zero_stage=2 deepspeed.offload_optimizer=cpu",
                                                 "deepspeed.zero_stage=1 deepspeed.offload_optimizer=cpu",
                                                 "deepspeed.zero_stage=3 deepspeed.offload_optimizer=cpu "
                                                 "deepspeed.offload_param=cpu"}
    check(r, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_every_engine_stage_and_nominal_k(world, tmp_path):
    r = run_cases("all", world, tmp_path / "results.json", ds_env(), script=SCRIPT)
    assert len(r["cases"]) == (30 if world == 1 else 27)
    check(r, world)


@pytest.mark.parametrize("given,refused", [({"managed_gradient_accumulation": False},
                                            "managed_gradient_accumulation=false makes"),
                                           ({"gradient_accumulation_steps": 3},
                                            "gradient_accumulation_steps=3 contradicts"),
                                           ({"managed_gradient_accumulation": True}, None)])
def test_a_users_deepspeed_json_that_would_move_the_boundary_is_refused(tmp_path, given, refused):
    """DeepSpeed's unmanaged accumulation refuses set_gradient_accumulation_boundary with an assertion
    deep in its engine: say so in one line, naming the file and the key, before DeepSpeed starts."""
    from exactrl.config import SFTConfig, load_config
    from exactrl.config.loader import ConfigError
    from exactrl.distributed.deepspeed_engine import ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(given))
    cfg = load_config(SFTConfig, None, ["distributed.backend=deepspeed", f"deepspeed.config={path}",
                                        "train.global_batch_size=8", "train.micro_batch_size=2"])
    if refused is None:
        assert ds_config(cfg, 2)["gradient_accumulation_steps"] == 2
        return
    with pytest.raises(ConfigError, match=f"^{path}: {refused}"):
        ds_config(cfg, 2)


@pytest.mark.slow  # ~30 s: one process on the throw-away DeepSpeed 0.18.5 environment
def test_on_a_deepspeed_with_the_offload_bug_the_canary_stops_the_first_step_it_corrupts(tmp_path):
    """DeepSpeed 0.18.5 (tests/old_deepspeed.py), steps of 1, 2, 3 micro-batches, the boundary placed by exactrl.
    ZeRO-2 + offload_optimizer cpu keeps about g_first + g_last of a step of 3 or more micro-batches whatever the
    configured K (PR #6550), and only the last of several when the configured K is 1 (PR #7981): the bug follows
    each step's count, not the config. ZeRO-1 + offload stays exact. The canary stops the first corrupted step."""
    from old_deepspeed import ROOT, VERSION, old_deepspeed_python

    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **ds_env(VERSION)}
    proc = subprocess.run([old_deepspeed_python(), str(SCRIPT), "old", "1", str(out)], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    k1, k2, zero1 = json.loads(out.read_text())["cases"]
    for case, step, seen, carried in ((k1, 1, 2, "0.5 "), (k2, 2, 3, "0.666667 ")):
        assert all(abs(v - 1.0) <= 1e-5 for v in case["canary"]) and len(case["canary"]) == step, case
        stopped = case["stopped"]
        assert f"canary failed at optimizer step {step}: the accumulated gradient carries {carried}" in stopped, case
        layout = f"backend=deepspeed, ZeRO stage 2, offload_optimizer cpu, K={seen},"
        assert f"over {seen} micro-batches; {layout}" in stopped
    assert zero1["stopped"] is None and zero1["micro_batches"] == [1, 2, 3] and zero1["rel_err"] <= TOL, zero1
