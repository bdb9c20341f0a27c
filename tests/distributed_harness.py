"""Runs a tests/dist/ script (equivalence.py by default) for one backend and world size and
checks fault reports; shared by tests/test_fsdp2.py, tests/test_deepspeed.py and
tests/test_rl_backends.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "dist" / "equivalence.py"


def run_cases(backend: str, world: int, out: Path, extra_env: dict | None = None, script: Path = SCRIPT) -> dict:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run([sys.executable, *launcher, str(script), backend, str(world), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# The bound on a case's update error relative to the one-pass reference, by the precision the layout computes the
# update in (tests/dist/equivalence.py precision). In float64 rounding leaves ~1e-15, while a lost or doubled
# micro-batch or a per-micro-batch normaliser moves the update by 1e-2 or more. DeepSpeed's fp32 master weights round
# float64 gradients and each update to fp32 element by element, the same on every CPU; a float32 run (ZeRO-0) rounds
# every operation, in an order that depends on the CPU's kernels.
TOL = {"float64": 1e-10, "fp32 master weights": 1e-5, "float32": 1e-5}


def over_bound(cases: list[dict]) -> list[dict]:
    """The cases whose relative error exceeds their precision's bound."""
    return [c for c in cases if not c["rel_err"] <= TOL[c["precision"]]]


# Every distributed backend at world size 1 and 2: the layouts a cross-backend test runs its script on.
LAYOUTS = [("fsdp2", 1), ("fsdp2", 2), ("deepspeed", 1), ("deepspeed", 2)]
LAYOUT_IDS = ["fsdp2-world1", "fsdp2-world2", "deepspeed-world1", "deepspeed-world2"]


def layout_params(slow: tuple[str, ...] = ()) -> list:
    """LAYOUTS as fixture parameters, those named in ``slow`` (ids of LAYOUT_IDS) behind the slow marker: a
    layout another test of the same engine already holds to its reference in the CI suite."""
    import pytest

    return [pytest.param(layout, id=name, marks=[pytest.mark.slow] if name in slow else [])
            for layout, name in zip(LAYOUTS, LAYOUT_IDS)]


def layout_results(request, tmp_path_factory, script: Path, tag: str) -> tuple[str, int, dict]:
    """(backend, world, results) of ``script`` run on the layout ``request.param`` (one of LAYOUTS)."""
    import pytest

    from old_deepspeed import ds_env

    backend, world = request.param
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp(f"{tag}-{backend}-{world}") / "results.json"
    return backend, world, run_cases(backend, world, out, ds_env() if backend == "deepspeed" else None, script=script)


def check_faults(faults: list[dict], backend: str, world: int, layouts: int) -> None:
    """Every fault on every layout stops the step, naming the backend and the reading."""
    assert len(faults) == 3 * layouts
    for f in faults:
        assert "canary failed at optimizer step 0" in f["message"], f
        assert f"backend={backend}" in f["message"] and f"world size {world}" in f["message"], f
        value = float(f["message"].split("carries ")[1].split(" ")[0])
        expected = {"drop": value < 0.99, "duplicate": value > 1.01, "rank_local_normalizer": abs(value - 1) > 0.01}
        assert expected[f["fault"]], f
