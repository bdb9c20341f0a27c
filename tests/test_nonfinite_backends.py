"""train.nonfinite on FSDP2 and DeepSpeed ZeRO-2 at world size 1 and 2, with a NaN on one rank
only: every rank stops (or, on FSDP2, skips) together and no weight changes
(tests/dist/nonfinite.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed_harness import run_cases
from old_deepspeed import ds_env

SCRIPT = Path(__file__).parent / "dist" / "nonfinite.py"


# FSDP2 at world size 1 under `slow` too: its world size 2 stops every rank here
@pytest.mark.parametrize("backend,world", [pytest.param("fsdp2", 1, marks=pytest.mark.slow), ("fsdp2", 2),
                                           ("deepspeed", 1),
                                           pytest.param("deepspeed", 2, marks=pytest.mark.slow)])  # ~20 s each
def test_a_nan_on_one_rank_stops_or_skips_every_rank(tmp_path, backend, world):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    r = run_cases(backend, world, tmp_path / "out.json", ds_env() if backend == "deepspeed" else None, script=SCRIPT)
    err = r["error"]
    expected = "the gradient norm is nan" if backend == "fsdp2" else "a micro-batch loss is inf or NaN"
    assert err["raised"] and f"optimizer step 1: {expected}, so the step was not applied" in err["raised"], err
    assert err["unchanged"], err
    if backend == "fsdp2":
        assert r["skip"] == {"raised": None, "skipped": 1, "unchanged": True, "moved_after": True}, r["skip"]
