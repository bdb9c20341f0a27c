"""RL on every backend: each policy loss (and CHORD's and HPT's mixed steps, ReLIFT's SFT step
with its code's mean of micro-batch means) and the critic's value loss apply exactly the
full-rollout update on FSDP2 and DeepSpeed (ZeRO 0-3, offload) at world size 1 and 2, with the
canary on; and the rollout each rank assembles, and its advantages, are those of one process
(tests/dist/rl_equivalence.py, one process group per backend and world size); and sampling with
sharded parameters keeps every rank stepping until the last rank's rows end.

The policy losses: PPO's clipped token ratio (GRPO, RLOO, REINFORCE++), with clip-higher, a
k3 KL and an entropy bonus under Dr.GRPO's constant-length aggregation (DAPO/Dr.GRPO); GSPO's
clipped sequence ratio; unclipped REINFORCE; LUFFY's and SRFT's terms on a rollout whose
groups hold a demonstration; UFT (GRPO on the policy's tokens, NLL on a demonstration prefix's)
and Prefix-RFT (the prefix's top-entropy tokens only) on sequences that mix both origins in
different shares. The value loss with and without PPO's value clipping. Each against a one-pass
reference written from the definitions, two SGD steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed_harness import layout_params, layout_results, over_bound
from exactrl.algorithms.registry import ALGORITHMS
from exactrl.losses.policy import POLICY_LOSSES

SCRIPT = Path(__file__).parent / "dist" / "rl_equivalence.py"
# the script's cases: every policy loss, the critic's value loss, every method's own terms, ReLIFT's SFT step
LOSSES = {*POLICY_LOSSES, "value", *(a.name for a in ALGORITHMS.values() if a.reshape), "relift_sft"}


# DeepSpeed at world size 1 under `slow` (~30 s): tests/test_deepspeed.py holds every stage at world size 1 to the
# full-batch update in CI, and this engine's world size 2 runs here
@pytest.fixture(scope="module", params=layout_params(slow=("deepspeed-world1",)))
def results(request, tmp_path_factory):
    return layout_results(request, tmp_path_factory, SCRIPT, "rl")


def test_every_policy_and_value_loss_matches_the_one_pass_reference(results):
    backend, world, r = results
    assert {c["loss"] for c in r["cases"]} == LOSSES
    if backend == "deepspeed":
        stages = {c["config"] for c in r["cases"]}
        assert len(stages) == 5, stages  # ZeRO 0, 1+offload, 2+offload, 3, 3+offload of optimizer and parameters
    bad = over_bound(r["cases"])
    assert not bad, bad
    print(f"{backend} world {world}: {len(r['cases'])} cases, max relative error "
          f"{max(c['rel_err'] for c in r['cases']):.2g}")


def test_ranks_assemble_the_one_process_rollout_and_advantages(results):
    _, world, r = results
    for algo, s in r["sharing"].items():
        assert s["same_rollout"] and s["ranks_agree"], (algo, s)
        assert s["max_diff_vs_one_process"] == 0.0, (algo, s)
    if world == 2:
        # Groups never straddle ranks, so group baselines computed from one rank's share are the
        # same; REINFORCE++ whitens over the whole rollout, so its share alone would differ.
        assert r["sharing"]["grpo"]["max_diff_rank_local"] == 0.0 and r["sharing"]["rloo"]["max_diff_rank_local"] == 0.0
        assert r["sharing"]["reinforce_pp"]["max_diff_rank_local"] > 1e-3


def test_sharded_ranks_sample_what_one_process_samples_when_one_rank_finishes_first(results):
    _, world, r = results
    if world == 1:
        assert r["synced_generation"] is None
        return
    ranks = r["synced_generation"]
    assert [x["rank"] for x in ranks] == [0, 1] and all(x["shards"] for x in ranks)
    assert set(ranks[0]["lengths"]) == {1} and max(ranks[1]["lengths"]) == 10  # rank 0 had nothing to do for 9 steps
    for x in ranks:
        assert x["same_tokens"] and x["max_logprob_diff"] < 1e-5, x
