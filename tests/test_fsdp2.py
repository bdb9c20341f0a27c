"""FSDP2 (gloo, CPU) at world size 1 and 2 applies exactly the full-batch update, and the
canary stops every injected fault.

One process group per world size runs every case (tests/dist/equivalence.py): the 4
aggregation modes x K in {1, 2, 4} (and 8 at world size 1) micro-batches per rank, plus K = 3,
with SGD (so the update is the gradient); AdamW against torch AdamW on the full batch; and
three faults the canary must stop: a micro-batch's gradient lost, one accumulated twice, and
each micro-batch normalised by its own tokens.
"""

from __future__ import annotations

import pytest
from distributed_harness import check_faults, run_cases

@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    world = request.param
    return world, run_cases("fsdp2", world, tmp_path_factory.mktemp(f"fsdp2-{world}") / "results.json")


def test_every_mode_and_k_matches_the_full_batch_sgd_update(results):
    world, r = results
    sgd = [c for c in r["cases"] if c["optim"] == "sgd"]
    assert {c["K"] for c in sgd} == ({1, 2, 3, 4, 8} if world == 1 else {1, 2, 3, 4})
    assert {c["mode"] for c in sgd} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    bad = [c for c in sgd if not c["rel_err"] <= 1e-5]
    assert not bad, bad


def test_adamw_matches_torch_adamw_on_the_full_batch(results):
    """Adam divides each gradient element by its own magnitude (+ eps). At eps=1e-6 that map is
    well conditioned for this model and the update matches to 1e-5 (measured ~2e-6). At torch's
    default eps=1e-8, elements whose gradient is near 1e-8 turn the ~1e-7 rounding of a
    different summation order into O(1) changes of their (tiny) updates: measured 1.7e-5, so
    the bound there is 1e-4 -- still far below what a lost or doubled micro-batch does (> 1e-1)."""
    _, r = results
    adamw = {c["eps"]: c["rel_err"] for c in r["cases"] if c["optim"] == "adamw"}
    assert adamw[1e-6] <= 1e-5 and adamw[1e-8] <= 1e-4, adamw


def test_canary_stops_dropped_duplicated_and_wrongly_normalised_micro_batches(results):
    world, r = results
    check_faults(r["faults"], "fsdp2", world, layouts=1)
