"""DeepSpeed ZeRO 0-3, with and without CPU offload, at world size 1 and 2 (gloo, CPU),
applies exactly the full-batch update (tests/dist/equivalence.py, one process group per
world size), and the canary stops every injected fault.

Covered with SGD (the update is the gradient): every stage x offload_optimizer (cpu where the
stage supports it) x K in {1, 2, 3, 4} (and 8 at world size 1) with token-mean; ZeRO-3 with
offload_param=cpu too; every aggregation mode on ZeRO-2 + offload (the configuration of the
DeepSpeed 0.15.2-0.18.x bug; the aggregation itself is backend-independent and is crossed
with every mode on FSDP2 and the single engine); a user's own DeepSpeed JSON
(deepspeed.config) with "auto" batch sizes and small buckets. AdamW against torch AdamW. And
faults -- a lost micro-batch gradient, a doubled one, a per-micro-batch normaliser -- on ZeRO
0, 1+offload, 2+offload, 3, 3+offload of optimizer and parameters. The real DeepSpeed bug on
an old version is tested in tests/test_audit_stack.py and tests/test_canary_real_bug.py.

ZeRO 1-3 train a float64 model (accumulating its gradients in float64) and step DeepSpeed's
fp32 master weights; ZeRO-0 reduces only fp32 (bf16, fp16) gradients, so it trains in fp32
(tests/dist/equivalence.py precision, bounds in distributed_harness.TOL).
"""

from __future__ import annotations

import pytest

from distributed_harness import check_faults, over_bound, run_cases
from old_deepspeed import ds_env

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is part of the test environment (requirements.txt)")



@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    world = request.param
    return world, run_cases("deepspeed", world, tmp_path_factory.mktemp(f"ds{world}") / "results.json", ds_env())


def test_every_stage_offload_and_k_matches_the_full_batch_sgd_update(results):
    world, r = results
    sgd = [c for c in r["cases"] if c["optim"] == "sgd"]
    layouts = {f"deepspeed.zero_stage={s} deepspeed.offload_optimizer={o}" for s in (0, 1, 2, 3) for o in ((
        "none", "cpu") if s else ("none",))}
    ks = {1, 2, 3, 4, 8} if world == 1 else {1, 2, 3, 4}
    for layout in layouts:
        assert {c["K"] for c in sgd if c["config"] == layout and c["mode"] == "token-mean"} == ks, layout
    assert {c["K"] for c in sgd if "offload_param=cpu" in c["config"]} == ks - {1, 3}
    assert {c["K"] for c in sgd if "deepspeed.config=" in c["config"]} == ks - {1, 3}
    assert {c["mode"] for c in sgd} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                        "seq-mean-token-sum-norm"}
    for c in r["cases"]:
        assert c["precision"] == ("float32" if "zero_stage=0" in c["config"] else "fp32 master weights"), c
    bad = over_bound(sgd)
    assert not bad, bad


def test_adamw_matches_torch_adamw_on_the_full_batch(results):
    """At torch's default eps=1e-8 and at 1e-6 (see tests/test_fsdp2.py)."""
    _, r = results
    adamw = [c for c in r["cases"] if c["optim"] == "adamw"]
    assert len(adamw) == 4
    bad = over_bound(adamw)
    assert not bad, bad


def test_canary_stops_dropped_duplicated_and_wrongly_normalised_micro_batches(results):
    world, r = results
    check_faults(r["faults"], "deepspeed", world, layouts=5)
    assert all(f"K={2 if world == 2 else 4}" in f["message"] for f in r["faults"])


def test_zero3_trains_float64_the_same_where_the_accelerator_has_fp16(tmp_path):
    """On an fp16-capable accelerator (Intel's AVX512-FP16 CPUs, every CUDA GPU) DeepSpeed's own partitioning asserted
    on a float64 model (zero.Init's dtype); elsewhere it took bf16 for it. Simulated here on any CPU: every ZeRO-3 case
    at world size 1 still matches the full-batch update within its bound, and the canary still stops every fault."""
    r = run_cases("deepspeed", 1, tmp_path / "results.json",
                  {**ds_env(), "EXACTRL_TEST_FP16_ACCELERATOR": "1", "EXACTRL_TEST_ZERO_STAGES": "3"})
    assert {c["config"].split()[0] for c in r["cases"]} == {"deepspeed.zero_stage=3"}
    # 4 micro-batch sizes and K=3, x offload none/cpu; offload_param x 3; AdamW x 2; the chunked head
    assert len(r["cases"]) == 16
    bad = over_bound(r["cases"])
    assert not bad, bad
    check_faults(r["faults"], "deepspeed", 1, layouts=2)
