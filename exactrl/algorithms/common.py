"""Checks and seeding every training command does before its loop."""

from __future__ import annotations

import math
import warnings

from exactrl.config.loader import ConfigError
from exactrl.config.schema import check_layout
from exactrl.config.schema_rl import check_rl_layout
from exactrl.data.files import read_rows
from exactrl.device import check_device, cpu_lacks_native_bf16, resolve_device
from exactrl.distributed.launch import rank, world_size


def check_world(cfg) -> None:
    """The config against the real number of processes (torchrun may have started more; under Ray, ray.ranks
    trainer ranks: this process, the driver, holds no model and its actors take their devices)."""
    on_ray = getattr(getattr(cfg, "ray", None), "enabled", False)
    world = cfg.ray.ranks if on_ray else world_size()
    try:
        device = None if on_ray else check_device(cfg)  # before any process group or model
        check_layout(cfg, world)
        if hasattr(cfg, "algo"):
            check_rl_layout(cfg, world)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not on_ray and cfg.model.dtype == "bf16" and device.type == "cpu" and cpu_lacks_native_bf16() and rank() == 0:
        warnings.warn("model.dtype=bf16 on a CPU without native bf16 (no avx512_bf16, amx_bf16 or bf16 among its "
                      "flags in /proc/cpuinfo): its bf16 matmuls are emulated, many times slower than fp32; set "
                      "model.dtype=fp32",
                      UserWarning, stacklevel=2)


def preflight(cfg, world: int) -> None:
    """What can be checked before starting ``world`` processes, in seconds and without a model: the
    device, the layout and that the data files read. Every rank would refuse these alike, after the
    imports and the rendezvous; the ranks check the rest (their refusal still ends in one line)."""
    try:
        resolve_device(cfg.distributed.device)  # not check_device: the launcher must not take a GPU
        check_layout(cfg, world)
        if hasattr(cfg, "algo"):
            check_rl_layout(cfg, world)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for path in (cfg.data.train, cfg.data.eval):
        if path not in (None, "auto", "builtin"):
            read_rows(path)


def steps_for(train_cfg, num_items: int, items_per_step: int) -> int:
    return train_cfg.max_steps or max(1, math.ceil(train_cfg.epochs * num_items / items_per_step))


def check_data_size(num_items: int, per_step: int, what: str, path) -> None:
    """A step larger than the data would hold some of it twice: a mistake, not a schedule."""
    if per_step > num_items:
        key = ("train.global_batch_size" if what in ("samples", "pairs")
               else "train.global_batch_size x algo.mini_batches / algo.group_size")
        raise ConfigError(f"{key} asks for {per_step} {what} per step (or rollout), but '{path}' has only {num_items}: "
                          "a step would repeat some of them; lower the batch size or add data")
