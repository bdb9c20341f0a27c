"""DeepSpeed ZeRO 0-3 (optionally with the optimizer and, at stage 3, the parameters
offloaded to CPU), behind the same engine interface.

Exactness, given how DeepSpeed handles gradients:
* ``engine.backward(loss, scale_wrt_gas=False)``: each micro-batch's loss is already its
  exact part of the step loss, so DeepSpeed must not divide it by its accumulation steps;
* the step's number of micro-batches comes from ``begin_step`` (the plan), not from the config:
  each backward tells DeepSpeed whether it is the step's last (``set_gradient_accumulation_boundary``,
  which decides where ZeRO 0/1 reduce, where ZeRO-2/3 copy the accumulated partition to the
  optimizer's fp32 buffer, and whether ``ds.step()`` applies the update), so a step with another
  count than ``gradient_accumulation_steps`` stays exact. The config's count is then nominal: it
  only has to satisfy DeepSpeed's check train_batch_size = micro x accumulation x world;
* DeepSpeed averages gradients over data-parallel ranks, so losses are scaled by the world
  size, as with FSDP2;
* the canary is a parameter DeepSpeed manages like the model's (partitioned, reduced,
  offloaded) and is read with ``deepspeed.utils.safe_get_full_grad`` after the last
  backward of the step, from the buffer the optimizer will read (the CPU fp32 partition
  under offload: where DeepSpeed 0.15.2-0.18.x loses micro-batches with ZeRO-2 and K >= 3).
  Its loss term is scaled by 2^-24 so that it adds nothing measurable to the gradient norm
  DeepSpeed clips by (a power of two, so the reading stays exact).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from exactrl.checks.canary import Canary
from exactrl.config.loader import ConfigError
from exactrl.device import place, process_device, process_group_backend
from exactrl.distributed.checkpoint import save_pretrained
from exactrl.distributed.engine import NonFiniteError, SingleEngine, enable_gradient_checkpointing, nonfinite_message
from exactrl.distributed.launch import is_main, single_process_env
from exactrl.distributed.optim import build_optimizer, lr_factor
from exactrl.models import lora

CANARY_SCALE = 2.0**-24
# torch 2.13 deprecates the collectives DeepSpeed's communication layer calls (once per rank and run, nothing the
# user can change); other warnings, torch's own included, stay shown.
DEEPSPEED_CALLS_DEPRECATED = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def hide_deprecations_deepspeed_causes() -> None:
    warnings.filterwarnings("ignore", message=DEEPSPEED_CALLS_DEPRECATED, category=FutureWarning)


class _WithCanary(torch.nn.Module):
    """The model and the canary as one module, so DeepSpeed manages both alike. The canary is
    a direct parameter of this root module and is touched inside its forward, where ZeRO-3
    has gathered the root's parameters anyway: a canary submodule of its own would cost a
    gather/release and four hooks per micro-batch."""

    def __init__(self, model, canary_param: torch.nn.Parameter | None):
        super().__init__()
        self.model = model
        if canary_param is not None:
            self.register_parameter("canary", canary_param)
        self.unit: torch.Tensor | None = None  # canary x 1 from the last forward with grad

    def forward(self, **inputs):
        if torch.is_grad_enabled() and hasattr(self, "canary"):
            self.unit = self.canary.sum()  # d(unit)/d(canary) = 1, whatever its value
        return self.model(**inputs)


def partition_for_zero3(deepspeed, module: torch.nn.Module, config: dict) -> None:
    """Partitions ``module``'s parameters for ZeRO-3 before ``deepspeed.initialize``, which then finds nothing left to
    convert. DeepSpeed's own conversion hands zero.Init the model's dtype, and zero.Init (0.19.8, Init._set_dtype) keeps
    a dtype it does not allow, and asserts on it, only where the accelerator has fp16 (CUDA; CPUs whose oneDNN has fp16,
    as Intel's Sapphire Rapids): elsewhere it silently takes bf16. A float64 model trained on some CPUs and failed on
    others. The dtype zero.Init only uses to pick buffers to keep in fp32 is said here: the model's own, float64 as
    float32 (full precision, nothing to keep back), so every accelerator takes one path."""
    dtype = next(module.parameters()).dtype
    allowed = (torch.float16, torch.bfloat16, torch.float32)
    deepspeed.zero.Init(module=module, config_dict_or_path=config, dtype=dtype if dtype in allowed else torch.float32)


def ds_config(cfg, world: int) -> dict:
    """The DeepSpeed config for exactrl's own batch and optimizer settings, or the user's JSON
    (``deepspeed.config``) with exactrl's batch sizes written in."""
    d, t = cfg.deepspeed, cfg.train
    k = t.global_batch_size // (t.micro_batch_size * world)
    base = json.loads(Path(d.config).read_text()) if d.config else {}
    zero = base.setdefault("zero_optimization", {})
    zero.setdefault("stage", d.zero_stage)
    if d.offload_optimizer != "none":
        zero.setdefault("offload_optimizer", {"device": d.offload_optimizer})
    if d.offload_param != "none":
        zero.setdefault("offload_param", {"device": d.offload_param})
    # DeepSpeed checks these three against each other; the accumulation boundary itself comes from each step's plan.
    for key, value in (("train_batch_size", t.global_batch_size), ("train_micro_batch_size_per_gpu",
                                                                   t.micro_batch_size),
                       ("gradient_accumulation_steps", k)):
        if base.get(key, "auto") not in ("auto", value):
            raise ConfigError(f"{d.config}: {key}={base[key]} contradicts train.* (which give {value}); remove it or "
                              "set it to \"auto\"")
        base[key] = value
    if base.get("managed_gradient_accumulation", True) is not True:
        # DeepSpeed >= 0.19 refuses set_gradient_accumulation_boundary in that mode (an assertion deep in its engine).
        raise ConfigError(f"{d.config}: "
                          f"managed_gradient_accumulation={json.dumps(base['managed_gradient_accumulation'])} makes "
                          "DeepSpeed's step() the accumulation boundary, but exactrl marks it at each step's last "
                          "backward (set_gradient_accumulation_boundary); remove the key or set it to true")
    base["gradient_clipping"] = t.max_grad_norm
    # exactrl's own torch optimizer (so SGD/AdamW match torch exactly), also under offload.
    base.setdefault("zero_force_ds_cpu_optimizer", False)
    base.setdefault("zero_allow_untested_optimizer", True)
    base.setdefault("steps_per_print", 10**9)
    return base


class DeepSpeedEngine(SingleEngine):
    backend = "deepspeed"

    @classmethod
    def from_config(cls, model, cfg, total_steps: int, device: torch.device, optim) -> DeepSpeedEngine:
        return cls(model, cfg.model, cfg.train, optim, cfg.audit, total_steps, cfg=cfg, device=device)

    def __init__(self, model, model_cfg, train, optim, audit, total_steps: int, cfg=None, device=None):
        self.device = device or process_device()
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        single_process_env()
        hide_deprecations_deepspeed_causes()
        import deepspeed

        self.deepspeed = deepspeed
        deepspeed.init_distributed(dist_backend=process_group_backend(self.device))
        # DeepSpeed moves the model to its accelerator itself; recorded so inputs follow it.
        place(model, self.device)
        if train.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.logprob_chunk = train.logprob_chunk_size
        self.set_faults(cfg.fault if cfg is not None else None)
        self.world_size, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        self.reduction_divisor = self.world_size
        self.model, self.dtype = model, model_cfg.dtype
        self.merge_on_save = model_cfg.lora.merge_on_save
        self.adapters_only = lora.is_peft(model)  # LoRA: checkpoints hold the adapters, not the frozen base
        self.canary = Canary(audit.canary, audit.canary_tol, self.describe) if audit.canary != "off" else None
        if self.canary is not None:  # in the model's dtype: ZeRO-3 flattens all parameters into buffers of one dtype
            self.canary.module.to(next(model.parameters()).dtype)
        self.wrapped = wrapped = _WithCanary(model, self.canary.param if self.canary else None)
        self.config = ds_config(cfg, self.world_size)
        self.stage = self.config["zero_optimization"]["stage"]
        if self.stage == 3:
            partition_for_zero3(deepspeed, wrapped, self.config)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=wrapped, optimizer=build_optimizer(wrapped.parameters(), optim), config=self.config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, optim, total_steps)))
        self.step_count = self._micro_seen = self._samples_seen = 0
        self._micro_planned: int | None = None
        self._finite = None  # all of this step's micro-batch losses finite so far (a bool tensor)

    @property
    def shards_parameters(self) -> bool:
        return self.stage == 3

    def forward(self, model, **inputs):
        # Through DeepSpeed's engine: ZeRO-3 counts micro-steps and gathers parameters there;
        # calling the inner model directly accumulated only the last micro-batches.
        return self.ds(**inputs)

    def describe(self) -> str:
        zero = self.config["zero_optimization"]
        return (f"backend=deepspeed, ZeRO stage {zero['stage']}, offload_optimizer "
                f"{zero.get('offload_optimizer', {}).get('device', 'none')}, "
                f"K={self._micro_planned or self.config['gradient_accumulation_steps']}, "
                f"world size {self.world_size}, deepspeed {self.deepspeed.__version__}, torch {torch.__version__}"
                f"{self.fault_note()}")

    def backward(self, loss: torch.Tensor, share: float, num_samples: int) -> None:
        last = self._next_micro_batch()
        if self.canary is not None:
            unit, self.wrapped.unit = self.wrapped.unit, None
            if unit is None:
                raise RuntimeError("DeepSpeedEngine.backward needs the micro-batch's forward through engine.forward "
                                   "(with grad)")
            loss = loss + unit * (share * CANARY_SCALE)
        loss = self._dropped(loss)
        # DeepSpeed steps inside ds.step() with no chance to look at the gradient first, so the
        # micro-batch losses are checked instead (as one flag per step: no sync per micro-batch).
        finite = torch.isfinite(loss.detach())
        self._finite = finite if self._finite is None else self._finite & finite
        # Set before each backward: ZeRO's gradient hooks read it during the backward. No ds.step() between
        # micro-batches: off the boundary it would only advance DeepSpeed's own micro-step count.
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)
        self._micro_seen += 1
        self._samples_seen += num_samples

    def step(self, plan) -> dict:
        self._check_accounting(plan)
        canary = None
        if self.canary is not None:
            grad = self.deepspeed.utils.safe_get_full_grad(self.canary.param)  # a collective under ZeRO
            canary = self.canary.verify(0.0 if grad is None else float(grad.sum()) / CANARY_SCALE, self.step_count,
                                        self._micro_seen)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = torch.tensor(float(self._finite is None or bool(self._finite)), device=self.device)
        self._finite = None
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if not finite.item():
            what = "a micro-batch loss is inf or NaN"
            raise NonFiniteError(nonfinite_message(what, self.step_count), self.step_count)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        if norm is not None and not torch.isfinite(torch.tensor(float(norm))).item():
            # Too late to keep these weights: stop before anything saves them.
            raise NonFiniteError(f"optimizer step {self.step_count + 1}: the gradient norm is {float(norm)} and "
                                 "DeepSpeed has applied it; the run stops before saving (lower optim.lr, check the "
                                 "data and rewards)", self.step_count)
        self.step_count += 1
        stats = {"grad_norm": float(norm) if norm is not None else None, "lr": lr, "micro_batches": self._micro_seen,
                 "samples": self._samples_seen, "canary": canary,
                 "canary_fired": self.canary.fired if self.canary else 0, "skipped_nonfinite": 0}
        self._micro_seen = self._samples_seen = 0
        self._micro_planned = None
        return stats

    def full_tensor(self, tensor):
        if self.stage != 3 or not hasattr(tensor, "ds_id"):  # below ZeRO-3 every rank holds the whole parameters
            return tensor
        with self.deepspeed.zero.GatheredParameters([tensor]):  # all-gathers the partitions, released on exit
            return tensor.data.clone()

    def full_model_state(self) -> dict:
        """The model's full weights (on rank 0 under ZeRO-3, where this is a collective)."""
        if self.stage == 3:
            state = self.ds._zero3_consolidated_16bit_state_dict()  # full weights (in the training dtype) on rank 0
            return {k.removeprefix("model."): v for k, v in (state or {}).items() if k.startswith("model.")}
        return self.model.state_dict()

    def save_pretrained(self, path: Path, tokenizer) -> Path:
        state = self.full_model_state()
        if is_main():
            save_pretrained(path, self.model, tokenizer, state, merge=self.merge_on_save)
        return Path(path)

    # Checkpoints: DeepSpeed's own per-rank files (model, ZeRO-partitioned optimizer state,
    # offloaded or not, and the scheduler) under deepspeed/, next to the Hugging Face model.
    def checkpoint_state(self):
        state = self.full_model_state()
        if self.adapters_only and state is not None:
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trainable}
        return state, {"step": self.step_count}

    def save_shards(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(Path(directory) / "deepspeed"), tag="state", save_latest=False,
                                exclude_frozen_parameters=self.adapters_only)

    def load_state_dict(self, state: dict, directory: Path | None = None) -> None:
        # Without the frozen base in the files (LoRA), the module load is partial: the base is already loaded.
        self.ds.load_checkpoint(str(Path(directory) / "deepspeed"), tag="state", load_optimizer_states=True,
                                load_lr_scheduler_states=True, load_module_strict=not self.adapters_only)
        self.step_count = state["step"]
