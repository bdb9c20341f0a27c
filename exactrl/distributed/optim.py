"""Optimizer and learning-rate schedule from OptimConfig."""

from __future__ import annotations

import math

import torch

from exactrl.config.schema import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 fused=fused_adamw(params) or None)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def fused_adamw(params) -> bool:
    """Whether AdamW runs torch's fused kernel (one pass over each tensor, as TRL's Trainer uses):
    when every parameter is a floating tensor, plain on the CPU or CUDA, or FSDP2's DTensor on
    CUDA (DTensor shards ``_fused_adamw_`` as a pointwise op: fused_ops in
    torch/distributed/tensor/_ops/_pointwise_ops.py; tests/test_fused_adamw.py). A DTensor on the
    CPU (FSDP2 there, or its CPU offload) keeps torch's default, the per-parameter loop, as
    before: those runs' figures stay where they were. DeepSpeed wraps this optimizer as built
    from the model's plain parameters."""
    def fusable(p) -> bool:
        plain = type(p.data) is torch.Tensor
        return p.is_floating_point() and p.device.type in (("cpu", "cuda") if plain else ("cuda",))

    return bool(params) and all(fusable(p) for p in params)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr for the update made at ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 1.0 - progress if cfg.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
