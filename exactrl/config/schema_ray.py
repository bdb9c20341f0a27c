"""`exactrl rl`'s Ray section: the same run as Ray actor groups (docs/scaling-out.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exactrl.config.schema import Section


class RayConfig(Section):
    enabled: bool = Field(False,
                          description="Run `exactrl rl` as Ray actor groups: the policy's trainer ranks, the "
                                      "reference, the critic and the rollout engines are actors placed by "
                                      "ray.placement; this process (the driver) runs the loop, the rewards, the "
                                      "metrics and checkpoints' bookkeeping, and holds only handles. Needs the ray "
                                      "extra (pip install 'exactrl[ray]').")
    address: str = Field("",
                         description="The Ray cluster: '' starts a local one for this run (stopped at its end), "
                                     "'auto' joins the one `ray start --head` started on this machine's cluster, or "
                                     "an address (HOST:6379, ray://HOST:10001).")
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="colocated: all roles share one set of bundles (rank i of the policy, reference and critic and "
                    "rollout engine i on bundle i, each actor taking a share of it); split: a set of bundles per "
                    "trainer role and one for the rollout engines, so no two roles share a device.")
    ranks: int = Field(1, ge=1,
                       description="Trainer ranks of the policy (and of the critic and reference): actors joined in "
                                   "one process group (gloo on CPU, NCCL on GPUs) running distributed.backend; the "
                                   "world size batch sizes must divide by. Replaces distributed.nproc_per_node.")
    engines: int = Field(1, ge=1,
                         description="Rollout engines: actors each holding a generator (rollout.engine) with its own "
                                     "copy of the policy's weights, pushed after every update; a rollout's prompts "
                                     "are split between them (each response keyed by its prompt and sample, so the "
                                     "split changes no response).")
    engine_tp: int = Field(1, ge=1,
                           description="Devices per rollout engine (vLLM's tensor_parallel_size; rollout.engine=vllm "
                                       "only): each engine actor takes a bundle of this many devices "
                                       "(ray.placement=split; refused colocated on GPUs, where the bundles are one GPU "
                                       "each) and its sync is verified on the shards gathered back.")
    async_rollouts: bool = Field(False,
                                 description="Sample rollout n+1 while the policy trains on rollout n (the engines "
                                             "are other actors than the trainer's ranks): each rollout after the "
                                             "first is sampled one update behind the weights that train on it, and "
                                             "algo.rollout_correction (required) weights it. One rollout is in "
                                             "flight, weights move only between rollouts (no rollout spans a "
                                             "sync); the staleness of each rollout is in metrics.jsonl. Without "
                                             "ray.enabled the same schedule runs in sequence: the same numbers, "
                                             "nothing overlaps (exactrl/rollout/schedule.py).")
    max_staleness: int = Field(1, ge=1,
                               description="With ray.async_rollouts: the most updates (rollouts trained on) a "
                                           "rollout may be sampled behind the weights that train on it. 1 pushes "
                                           "the weights before every rollout; k > 1 skips pushes while the next "
                                           "rollout stays within k (fewer syncs, staler samples).")


def check_ray(cfg) -> None:
    """What a Ray run cannot honour, refused when the config loads."""
    r = cfg.ray
    if r.async_rollouts and cfg.algo.rollout_correction == "none":
        raise ValueError("ray.async_rollouts=true samples each rollout after the first with weights an update behind "
                         "the ones that train on it: set algo.rollout_correction (tis, icepop or seq_mask) to weight "
                         "those stale samples")
    if r.async_rollouts and cfg.train.resume_from:
        raise ValueError(f"train.resume_from={cfg.train.resume_from} with ray.async_rollouts=true: the rollout in "
                         "flight at the checkpoint was sampled with weights the checkpoint no longer holds, so the "
                         "run cannot continue exactly; resume with ray.async_rollouts=false")
    if r.async_rollouts and cfg.rollout.vllm.sleep_level in (1, 2):
        raise ValueError(f"rollout.vllm.sleep_level={cfg.rollout.vllm.sleep_level} with ray.async_rollouts=true: the "
                         "engine samples the next rollout while the trainer trains, so it has no time to sleep; set "
                         "rollout.vllm.sleep_level=auto (0 here) or ray.async_rollouts=false")
    if cfg.rollout.vllm.weight_channel == "nccl" and not (r.enabled and r.placement == "split"):
        raise ValueError("rollout.vllm.weight_channel=nccl: NCCL refuses two members of a group on one GPU, and "
                         "here the vLLM engine shares the trainer's (a plain run, or ray.placement=colocated); it "
                         "needs ray.enabled=true ray.placement=split, else use gloo (or auto)")
    if not r.enabled:
        return
    if cfg.distributed.nproc_per_node > 1:
        raise ValueError(f"distributed.nproc_per_node={cfg.distributed.nproc_per_node} with ray.enabled=true: Ray "
                         "starts the trainer ranks itself; set ray.ranks instead (and run one exactrl process)")
    if r.engine_tp > 1 and cfg.rollout.engine == "hf":
        raise ValueError(f"ray.engine_tp={r.engine_tp}: rollout.engine=hf (the Hugging Face decode loop) has no "
                         "tensor parallelism; set ray.engine_tp=1")
