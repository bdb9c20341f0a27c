"""Where a run's roles live: in this process (one machine, or one rank of torchrun), or as Ray actor
groups (ray.enabled, exactrl/workers/groups.py). The RL loop asks the same of either:

    roles = place(cfg)
    policy = roles.worker("policy", path, ...)        # a Worker, or a group of rank actors behind its methods
    generator = roles.generator(policy, tokenizer)    # the Generator protocol (exactrl/rollout/generator.py)
    ...
    roles.close()                                     # ends the actors (nothing in one process)
"""

from __future__ import annotations

from exactrl.distributed.launch import rank
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.vllm_generator import vllm_generator
from exactrl.workers.worker import Worker


class InProcess:
    """Every role in this process: the policy, reference and critic workers beside each other, and a
    generator decoding with the policy's own model object (nothing to sync but the check), or a
    vLLM engine process per rank (rollout.engine=vllm), loading the policy's starting model."""

    def __init__(self, cfg, run_dir):
        self.cfg, self.run_dir, self.policy_path, self.engine = cfg, run_dir, None, None

    def worker(self, role: str, path: str, **kwargs) -> Worker:
        if role == "policy":
            self.policy_path = path
        return Worker.build(self.cfg, role, path, **kwargs)

    def generator(self, policy: Worker, tokenizer):
        if self.cfg.rollout.engine == "vllm":
            self.engine = vllm_generator(self.cfg, self.policy_path, tokenizer, self.run_dir, rank())
            return self.engine
        # Several ranks holding shards of the parameters must run every forward together
        # (generate's synced_gpus keeps a rank whose responses have all ended stepping with the others).
        return HFEngine(policy.model, tokenizer, self.cfg.rollout.batch_size, synced=policy.engine.synced_decoding)

    def close(self) -> None:
        if self.engine is not None:  # an engine process of its own
            self.engine.close()


def place(cfg, run_dir, phase: str):
    """The roles of an RL run with config ``cfg``: Ray actor groups when ray.enabled, else this process."""
    if getattr(cfg, "ray", None) is not None and cfg.ray.enabled:
        from exactrl.workers.groups import RayRoles

        return RayRoles(cfg, run_dir, phase)
    return InProcess(cfg, run_dir)
