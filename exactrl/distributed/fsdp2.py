"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state
sharded over ranks; gloo on CPU, NCCL on GPUs.

FSDP2 averages gradients over ranks when it reduce-scatters them, so each micro-batch's
loss (its exact part of the *global* step loss) is multiplied by the world size before
backward, making the reduced gradient the plain sum over every micro-batch of every rank:
the full-batch gradient. The canary is sharded and reduced by FSDP2 like any layer, so it
checks that arithmetic where the optimizer reads the gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from exactrl.distributed.checkpoint import save_pretrained
from exactrl.distributed.engine import SingleEngine, prepare_model
from exactrl.distributed.launch import init_process_group, is_main, rank, world_size
from exactrl.models import lora


class FSDP2Engine(SingleEngine):
    backend = "fsdp2"
    shards_parameters = True

    @classmethod
    def from_config(cls, model, cfg, total_steps: int, device: torch.device, optim) -> FSDP2Engine:
        return cls(model, cfg.model, cfg.train, optim, cfg.audit, total_steps, device=device,
                   cpu_offload=cfg.distributed.fsdp_cpu_offload, fault=cfg.fault)

    def __init__(self, model, model_cfg, train, optim, audit, total_steps: int, device=None, cpu_offload: bool = False,
                 fault=None):
        self.device = prepare_model(model, train, device)  # before sharding: each rank shards from its device
        init_process_group()
        self.world_size, self.rank = world_size(), rank()
        self.reduction_divisor = self.world_size
        # cpu_offload: the sharded parameters, gradients and optimizer state live on the CPU (the
        # optimizer steps there); each unit's parameters are copied to the device for its compute.
        options = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
        # One FSDP unit per decoder layer (all-gathered one at a time), then the root.
        hf = lora.base_model(model)  # under a LoRA model's peft wrapper
        for layer in getattr(getattr(hf, "model", hf), "layers", []):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        super().__init__(model, model_cfg, train, optim, audit, total_steps, fault=fault)
        if self.canary is not None:
            fully_shard(self.canary.module, **options)

    def full_tensor(self, tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # all-gathers the shards

    def save_pretrained(self, path: Path, tokenizer) -> Path:
        # A collective: every rank takes part, the main process writes.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if is_main():
            save_pretrained(path, self.model, tokenizer, state, merge=self.merge_on_save)
        return Path(path)

    def checkpoint_state(self):
        # Full (unsharded) weights and optimizer state, keyed by parameter name, on the main
        # process; every rank takes part. A LoRA model's checkpoint holds only its adapters.
        adapters_only = lora.is_peft(self.model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if adapters_only:  # a frozen weight tied to another (lm_head to the embeddings) still comes back
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        return model_sd, {"optimizer": optim_sd, "scheduler": self.scheduler.state_dict(), "step": self.step_count}

    def load_state_dict(self, state: dict, directory: Path | None = None) -> None:
        # Every rank read the full state from the checkpoint; each keeps its own shard of it. An optimizer without
        # per-parameter tensors (SGD without momentum) has only its groups' settings to restore: torch's loader
        # finds no tensor to place the state by and refuses ("Expected device to be set").
        optim = state["optimizer"]
        if any(torch.is_tensor(v) and v.dim() > 0 for s in optim.get("state", {}).values() for v in s.values()):
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=StateDictOptions(full_state_dict=True))
        else:
            for group, saved in zip(self.optimizer.param_groups, optim["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
