"""LoRA on FSDP2 (gloo, CPU) at world size 1 and 2 (tests/dist/lora_equivalence.py): the
adapters' update equals the one-pass full-batch reference through the same adapters, the base
weights never move, a checkpoint holds only the adapters, and the canary stops a lost
micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_harness import run_cases

pytest.importorskip("peft")
SCRIPT = Path(__file__).parent / "dist" / "lora_equivalence.py"


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    world = request.param
    return world, run_cases("fsdp2", world, tmp_path_factory.mktemp(f"lora-{world}") / "results.json", script=SCRIPT)


def test_adapter_update_matches_the_full_batch_reference_and_the_base_stays(results):
    world, r = results
    assert {c["mode"] for c in r["cases"]} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    assert {c["K"] for c in r["cases"]} == ({1, 2, 4, 8} if world == 1 else {1, 2, 4})
    bad = [c for c in r["cases"] if not (c["rel_err"] <= 1e-5 and not c["base_moved"])]
    assert not bad, bad


def test_checkpoint_holds_only_the_adapters(results):
    _, r = results
    assert r["checkpoint_keys"] == r["trainable"] and all("lora_" in k for k in r["trainable"])


def test_canary_stops_a_lost_micro_batch(results):
    world, r = results
    assert "canary failed at optimizer step 0" in r["fault"] and f"backend=fsdp2, world size {world}" in r["fault"], r["fault"]
