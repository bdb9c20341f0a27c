"""Train engines: own the model's optimizer, accumulate micro-batch gradients, step.

Worker.train_step (exactrl/workers/worker.py) drives every engine the same way:

    mine = plan.for_rank(engine.rank)
    engine.begin_step(len(mine.micro_batches))
    for mb in mine.micro_batches:
        with engine.autocast():
            loss, share = ...  # this micro-batch's exact share of the step's objective, and its canary share
        engine.backward(loss, share, num_samples=rows)
    stats = engine.step(mine)

``single`` is one process. The loss handed to ``backward`` is already this micro-batch's
exact part of the step loss, so the engine only sums gradients (no division by the number
of accumulation steps) and clipping acts on the full accumulated gradient. A step has as
many micro-batches as its plan gives this rank, which may change from step to step
(mixed-policy methods): ``begin_step`` says how many, so an engine that must know its
accumulation boundary (DeepSpeed) places it there. Before each optimizer step the engine
checks sample accounting and the canary (exactrl/checks/canary.py).
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import torch

from exactrl.checks.canary import Canary
from exactrl.config.faults import injected
from exactrl.config.loader import ConfigError
from exactrl.config.schema import AuditConfig, FaultConfig, ModelConfig, OptimConfig, TrainConfig
from exactrl.device import place, process_device, use_device
from exactrl.distributed.checkpoint import NonFiniteError, save_pretrained, write_part
from exactrl.distributed.compile import compile_layers
from exactrl.distributed.export import hf_tensors
from exactrl.distributed.launch import is_main
from exactrl.distributed.optim import build_optimizer, build_scheduler
from exactrl.distributed.step_plan import StepPlan
from exactrl.dtypes import autocast_for


class SampleAccountingError(RuntimeError):
    """An optimizer step did not see each sample of its plan exactly once."""


def nonfinite_message(what: str, step: int) -> str:
    return (f"optimizer step {step + 1}: {what}, so the step was not applied (train.nonfinite=error); lower optim.lr, "
            "check the data and rewards, or set train.nonfinite=skip to skip such steps")


class SingleEngine:
    world_size = 1
    rank = 0
    backend = "single"
    shards_parameters = False  # True when a forward needs every rank (FSDP2, ZeRO-3)

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, train: TrainConfig, optim: OptimConfig,
                 audit: AuditConfig, total_steps: int, device: torch.device | None = None,
                 fault: FaultConfig | None = None):
        self.model = model
        self.set_faults(fault)
        if not hasattr(self, "device"):  # FSDP2 decides it before sharding
            self.device = prepare_model(model, train, device)
        if train.compile:  # after FSDP2's fully_shard, which swaps the layers' class (distributed/compile.py)
            compile_layers(model)
        self.canary = Canary(audit.canary, audit.canary_tol, self.describe) if audit.canary != "off" else None
        if self.canary is not None:
            self.canary.module.to(self.device)
        self.dtype = model_cfg.dtype
        self.merge_on_save = model_cfg.lora.merge_on_save  # LoRA: final/ also holds the merged model
        self.max_grad_norm = train.max_grad_norm
        self.nonfinite = train.nonfinite
        self.logprob_chunk = train.logprob_chunk_size  # tokens per log-softmax chunk (exactrl/losses/token_losses.py)
        self.skipped = 0  # steps skipped for a non-finite gradient (train.nonfinite=skip), logged as a running total
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        self.step_count = 0
        self._micro_planned: int | None = None  # this step's micro-batches on this rank, from begin_step
        self._micro_seen = 0
        self._samples_seen = 0

    @property
    def synced_decoding(self) -> bool:
        """Whether decoding must keep every rank stepping (parameters sharded over several ranks)."""
        return self.world_size > 1 and self.shards_parameters

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg, total_steps: int, device: torch.device,
                    optim: OptimConfig) -> SingleEngine:
        return cls(model, cfg.model, cfg.train, optim, cfg.audit, total_steps, device=device, fault=cfg.fault)

    def autocast(self):
        return autocast_for(self.dtype, self.device)

    def forward(self, model, **inputs):
        """The training forward pass (an engine may need to route it through its wrapper)."""
        return model(**inputs)

    def describe(self) -> str:
        """Backend, layout and versions, for error messages."""
        return (f"backend={self.backend}, world size {self.world_size}, device {self.device}, dtype {self.dtype}, "
                f"torch {torch.__version__}{self.fault_note()}")

    def fault_note(self) -> str:
        """What a failure message adds when a fault is injected on purpose (exactrl/config/faults.py)."""
        return f"; {' and '.join(self.faults)} injected ON PURPOSE (exactrl/config/faults.py)" if self.faults else ""

    # What the backend's own gradient reduction divides by (FSDP2 averages over ranks).
    reduction_divisor = 1

    def set_faults(self, fault: FaultConfig | None) -> None:
        """The known bugs this engine reproduces on purpose (exactrl/config/faults.py): ``drops`` loses the
        middle micro-batches of each step; ``mean_of_means`` tells the worker to aggregate so."""
        self.faults = injected(fault)
        self.drops = "fault.dropped_micro_batches" in self.faults
        self.mean_of_means = "fault.mean_of_means" in self.faults

    def _dropped(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (with its canary term), or 0 x it when fault.dropped_micro_batches loses this
        micro-batch: every one but the first and the last of the step, as DeepSpeed 0.15.2-0.18.x's
        ZeRO-2 CPU offload does. Still backpropagated: every rank runs the same collectives."""
        middle = 0 < self._micro_seen < self._micro_planned - 1
        return loss * 0.0 if self.drops and middle else loss

    def begin_step(self, num_micro_batches: int) -> None:
        """Start an optimizer step of ``num_micro_batches`` backward calls on this rank (the plan's
        count for this rank, which may differ from step to step); call it before the first."""
        if self._micro_planned is not None or self._micro_seen:
            raise SampleAccountingError(f"step {self.step_count}: begin_step({num_micro_batches}) before the step "
                                        f"begun with {self._micro_planned} micro-batches ({self._micro_seen} "
                                        "backpropagated) was taken")
        if num_micro_batches < 1:
            raise SampleAccountingError(f"step {self.step_count}: a step needs at least one micro-batch, the plan "
                                        f"gives {num_micro_batches} on rank {self.rank}")
        if self.world_size > 1:
            # A backward reduces over ranks (FSDP2 in each one, DeepSpeed at its boundary): a rank with fewer
            # micro-batches than another would leave that one's reductions waiting, or pair different micro-batches.
            most, minus_fewest = self._reduce([num_micro_batches, -num_micro_batches], torch.distributed.ReduceOp.MAX)
            if most != -minus_fewest:
                raise SampleAccountingError(f"step {self.step_count}: the plan gives the ranks different numbers of "
                                            f"micro-batches (from {int(-minus_fewest)} to {int(most)}; "
                                            f"{num_micro_batches} on rank {self.rank}); every rank must backpropagate "
                                            "as many")
        self._micro_planned = num_micro_batches

    def _next_micro_batch(self) -> bool:
        """Count one backward of the step begun; whether it is the step's last."""
        if self._micro_planned is None:
            raise SampleAccountingError(f"step {self.step_count}: backward before begin_step(number of micro-batches)")
        if self._micro_seen >= self._micro_planned:
            raise SampleAccountingError(f"step {self.step_count}: backward of micro-batch {self._micro_seen + 1} in a "
                                        f"step begun with {self._micro_planned}")
        return self._micro_seen + 1 == self._micro_planned

    def _check_accounting(self, plan: StepPlan) -> None:
        """Every sample of the plan backpropagated once, in as many micro-batches as the step began with."""
        if self._micro_seen != len(plan.micro_batches) or self._samples_seen != plan.num_samples:
            raise SampleAccountingError(
                f"step {self.step_count}: planned {len(plan.micro_batches)} micro-batches / {plan.num_samples} "
                f"samples, backward saw {self._micro_seen} / {self._samples_seen}"
            )
        if self._micro_seen != self._micro_planned:
            raise SampleAccountingError(f"step {self.step_count}: begin_step announced {self._micro_planned} "
                                        f"micro-batches, the plan and backward have {self._micro_seen}")

    def backward(self, loss: torch.Tensor, share: float, num_samples: int) -> None:
        """Backpropagate one micro-batch's part of the step loss; ``share`` feeds the canary."""
        self._next_micro_batch()
        if self.canary is not None:
            loss = loss + self.canary.term(share)
        loss = self._dropped(loss)
        (loss * self.reduction_divisor if self.reduction_divisor != 1 else loss).backward()
        self._micro_seen += 1
        self._samples_seen += num_samples

    def step(self, plan: StepPlan) -> dict[str, float]:
        self._check_accounting(plan)
        canary = self.canary.check(self.step_count, self._micro_seen) if self.canary is not None else None
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # a sharded (DTensor) norm
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)  # the full gradient's, the same on every rank: any NaN or inf shows here
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not torch.isfinite(torch.tensor(grad_norm)).item()
        if skipped and self.nonfinite == "error":
            what = f"the gradient norm is {grad_norm}"
            raise NonFiniteError(nonfinite_message(what, self.step_count), self.step_count)
        if not skipped:
            self.optimizer.step()
        self.skipped += skipped
        # A skipped step still moves the schedule and the step count, so step N stays step N on resume.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        stats = {"grad_norm": grad_norm, "lr": lr, "micro_batches": self._micro_seen, "samples": self._samples_seen,
                 "canary": canary, "canary_fired": self.canary.fired if self.canary else 0,
                 "skipped_nonfinite": self.skipped}
        self._micro_seen = self._samples_seen = 0
        self._micro_planned = None
        return stats

    def _reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def save_pretrained(self, path: Path, tokenizer) -> Path:
        """The model in Hugging Face format (on the main process)."""
        return save_pretrained(path, self.model, tokenizer, merge=self.merge_on_save)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of one of the model's tensors from what this rank holds (a collective when sharded)."""
        return tensor

    def export_weights(self, adapters: bool = False):
        """The model's full weights, one tensor at a time, named as its saved Hugging Face
        checkpoint names them (a LoRA model merged, or with ``adapters`` its adapters alone):
        exactrl/distributed/export.py. Every rank takes part when the weights are sharded."""
        return hf_tensors(self.model, self.full_tensor, adapters)

    def save_checkpoint(self, directory: Path, tokenizer, state: dict) -> None:
        """This model's part of a checkpoint being written into ``directory`` (every rank calls
        it): its weights, the tokenizer, its engine's state and the run's ``state``."""
        weights, engine_state = self.checkpoint_state()  # collectives when sharded
        self.save_shards(directory)
        if is_main():
            write_part(directory, self.model, tokenizer, weights, {"engine": engine_state, **state})

    def checkpoint_state(self) -> tuple[dict | None, dict]:
        """(full model weights, or None for the model's own state_dict; optimizer, scheduler
        and step) for a checkpoint. A collective when the model is sharded."""
        return None, {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                      "step": self.step_count}

    def save_shards(self, directory: Path) -> None:
        """Per-rank files a backend keeps itself (DeepSpeed); nothing here."""

    def load_state_dict(self, state: dict, directory: Path | None = None) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]


def prepare_model(model: torch.nn.Module, train: TrainConfig, device: torch.device | None) -> torch.device:
    """Put ``model`` on ``device`` (default: this process's) with train.gradient_checkpointing
    applied; return the device."""
    device = device or process_device()
    place(model, device)
    if train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return device


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them. The
    non-reentrant variant: it keeps the autograd graph intact (the reentrant one drops
    gradients of inputs that do not require grad and mishandles keyword arguments)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: the model inside
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.gradient_checkpointing=true: {type(base).__name__} does not support it (its "
                          "supports_gradient_checkpointing is False in transformers); set "
                          "train.gradient_checkpointing=false")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# distributed.backend -> the engine class, as "module:Class": imported when a run asks for it,
# so DeepSpeed is needed only by the runs that use it.
ENGINES = {
    "single": "exactrl.distributed.engine:SingleEngine",
    "fsdp2": "exactrl.distributed.fsdp2:FSDP2Engine",
    "deepspeed": "exactrl.distributed.deepspeed_engine:DeepSpeedEngine",
}


def build_engine(model, cfg, total_steps: int, optim: OptimConfig | None = None) -> SingleEngine:
    """The engine named by ``cfg.distributed.backend``, built from the run's (validated) config,
    on the device distributed.device gives; ``optim``: a section of that config other than
    cfg.optim (the critic's critic.optim)."""
    module, name = ENGINES[cfg.distributed.backend].split(":")
    return getattr(importlib.import_module(module), name).from_config(model, cfg, total_steps,
                                                                      use_device(cfg.distributed.device),
                                                                     optim or cfg.optim)
