"""fault.dropped_micro_batches reproduces DeepSpeed's CPU-offload bug on FSDP2 and on DeepSpeed ZeRO-2
with CPU offload itself (tests/dist/faults.py): the applied update is plain SGD on each rank's first
and last micro-batches only, and the canary, under warn, reads exactly their share and counts the
step. World size 2 runs in CI (one launch, both engines); world size 1 is slow."""

from __future__ import annotations

import pytest

from distributed_harness import run_cases
from old_deepspeed import ds_env
from test_variable_micro_batches import SCRIPT as VARIABLE

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is part of the test environment (requirements.txt)")

SCRIPT = VARIABLE.parent / "faults.py"


def check(r: dict) -> None:
    assert [c["backend"] for c in r["cases"]] == ["fsdp2", "deepspeed"]
    for c in r["cases"]:
        assert c["micro_batches"] == 4 and c["kept_share"] == 0.5, c
        assert abs(c["canary"] - c["kept_share"]) <= 1e-5 and c["canary_fired"] == 1, c
        assert c["rel_err_bugged"] <= 1e-6, c  # the update of the kept micro-batches, to fp32 rounding
        assert c["rel_err_full"] >= 0.1, c  # and far from the full batch's


@pytest.mark.parametrize("world", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_dropped_micro_batches_on_fsdp2_and_deepspeed_zero2_offload(world, tmp_path):
    check(run_cases("ci", world, tmp_path / "results.json", ds_env(), script=SCRIPT))
