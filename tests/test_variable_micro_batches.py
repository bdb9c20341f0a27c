"""Steps with different micro-batch counts (1, 3, 4, 2 per rank, as mixed-policy methods give them)
stay exact on every engine at world size 1 and 2 (tests/dist/variable_micro.py): the plan's count,
given to ``engine.begin_step``, places DeepSpeed's accumulation boundary, not the configured
gradient_accumulation_steps (2 here). Before that, ZeRO 1-3 applied an update off by 48-89% of
it with the canary off, and the canary stopped step 0 ("carries 0 ... over 1 micro-batches").

Fast: FSDP2 and DeepSpeed ZeRO-2 + offload_optimizer cpu, ZeRO-1 + offload, ZeRO-3 + offload of
the optimizer and parameters. Slow: the single engine, every stage x offload, and nominal
accumulation steps 1, 2 and 4.

fp32 throughout; the bound, 1e-6 of the update, leaves room for the summation order alone (a
micro-batch's squared errors summed apart from the others, measured ~2e-7), while a misplaced
boundary moves the update by tens of percent.
"""

from __future__ import annotations

import json
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
                                                 "deepspeed.zero_stage=3 deepspeed.offload_optimizer=cpu deepspeed.offload_param=cpu"}
    check(r, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_every_engine_stage_and_nominal_k(world, tmp_path):
    r = run_cases("all", world, tmp_path / "results.json", ds_env(), script=SCRIPT)
    assert len(r["cases"]) == (30 if world == 1 else 27)
    check(r, world)


@pytest.mark.parametrize("given,refused", [({"managed_gradient_accumulation": False}, "managed_gradient_accumulation=false makes"),
                                           ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps=3 contradicts"),
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
