"""The worker: one model, the engine that trains it (none for a frozen model) and its device.

Every role of a run (policy, reference, critic, later a reward model) is a worker, built from
the run's config by role, and is driven the same way:

    worker = Worker.build(cfg, "policy", path, ...)              # model, self-checks, engine
    fields = worker.forward(samples, "logprobs", micro_batches)   # per-token, no gradient
    result = worker.train_step(batch, plan, loss_fn)             # one verified optimizer step
    worker.push_weights(generator)                               # to a rollout engine
    worker.save(path, tokenizer)                                 # Hugging Face format

Nothing outside a worker needs its model or engine: checkpoints go through ``save_state`` /
``load_state``, a generator receives ``export_weights()``.

``train_step`` is the only place micro-batches are backpropagated: each one's exact share of
the step loss under the plan's one normaliser, then the engine's sample accounting, canary
and optimizer step. ``forward`` computes a per-token field for this rank's micro-batches and
hands every rank every sample's values, so per-token fields computed once per rollout (old
log-probs, reference log-probs, values) are the same on every rank.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exactrl.data.batch import Sample
from exactrl.distributed.collectives import gather
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import StepPlan
from exactrl.losses.token_losses import token_entropy, token_logprobs
from exactrl.models.lora import reference_mode
from exactrl.models.packing import model_batch
from exactrl.workers.load import load_model

# loss_fn(worker, samples of one micro-batch, the step's normaliser) -> (this micro-batch's part
# of the step loss, its canary share, its metrics)
LossFn = Callable[["Worker", list[Sample], object], tuple[torch.Tensor, float, dict[str, float]]]


# role -> the worker class that builds it, as "module:Class" (imported when a run asks for the
# role, as the engines are): a reward model joins with one row.
ROLES = {
    "policy": "exactrl.workers.worker:Worker",
    "reference": "exactrl.workers.worker:Worker",
    "critic": "exactrl.workers.critic:Critic",
}


@dataclass
class StepResult:
    loss: float  # the step's loss, summed over micro-batches and ranks
    parts: list[dict[str, float]] = field(default_factory=list)  # this rank's per-micro-batch metrics
    stats: dict = field(default_factory=dict)  # the engine's: grad_norm, lr, canary, micro-batches, samples...


class Worker:
    """``role``'s model; ``engine`` trains it (None: frozen, forward only); forwards run under
    ``autocast`` (the engine's, else the one given); sequences are packed when ``packed``."""

    def __init__(self, role: str, model: torch.nn.Module, engine=None, *, pad_id: int, packed: bool = True,
                 temperature: float = 1.0, autocast: Callable | None = None, logprob_chunk: int | None = None,
                 mode: Callable | None = None):
        self.role, self.model, self.engine = role, model, engine
        self.pad_id, self.packed, self.temperature = pad_id, packed, temperature
        self.autocast = autocast or (engine.autocast if engine is not None else contextlib.nullcontext)
        self.logprob_chunk = logprob_chunk if logprob_chunk is not None else getattr(engine, "logprob_chunk", 0)
        self.mode = mode or contextlib.nullcontext  # entered around forward: e.g. LoRA's adapters off for the reference

    @classmethod
    def build(cls, cfg, role: str, path: str, *, run_dir: Path, phase: str, longest: int, pad_id: int,
              total_steps: int = 1, checkpoint: str | None = None, policy: Worker | None = None) -> Worker:
        """The ``role`` worker of a run with config ``cfg``, its model loaded from ``path`` (and
        ``checkpoint``'s weights when resuming) and self-checked (exactrl/workers/load.py):
        * policy: trained by an engine over ``total_steps`` optimizer steps;
        * reference: frozen, run like ``policy``'s forward (its autocast and log-prob chunks);
          with LoRA it is the policy's own model with its adapters off, not a second copy;
        * critic: exactrl/workers/critic.py.
        ``longest``: the run's longest sequence (for the self-checks)."""
        if role not in ROLES:
            raise ValueError(f"no worker role '{role}'; the roles are {', '.join(ROLES)}")
        module, name = ROLES[role].split(":")
        return getattr(importlib.import_module(module), name)._build(
            cfg, role, path, run_dir=run_dir, phase=phase, longest=longest, pad_id=pad_id, total_steps=total_steps,
            checkpoint=checkpoint, policy=policy)

    @classmethod
    def _build(cls, cfg, role, path, *, run_dir, phase, longest, pad_id, total_steps, checkpoint, policy) -> Worker:
        # The log-probs of an RL run are those of its sampling temperature.
        temperature = cfg.rollout.temperature if hasattr(cfg, "rollout") else 1.0
        packed = cfg.train.padding_free
        if role == "policy":
            model = load_model(cfg, path, run_dir, phase, "policy", longest, checkpoint=checkpoint)
            return cls("policy", model, build_engine(model, cfg, total_steps), pad_id=pad_id, packed=packed,
                       temperature=temperature)
        if policy is None:
            raise ValueError("the reference worker is built after the policy's (it computes like it)")
        common = {"pad_id": pad_id, "packed": packed, "temperature": temperature, "autocast": policy.engine.autocast,
                  "logprob_chunk": policy.engine.logprob_chunk}
        if cfg.model.lora.rank > 0:
            return cls("reference", policy.model, mode=lambda: reference_mode(policy.model), **common)
        return cls("reference", load_model(cfg, path, run_dir, phase, "reference", longest, trainable=False), **common)

    def model_batch(self, samples: list[Sample]):
        return model_batch(self.model, [s.ids for s in samples], self.pad_id, self.packed)

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-token ``name`` [rows, L-1] from one forward's logits (packed or padded rows)."""
        if name == "logprobs":
            return token_logprobs(logits, input_ids, self.temperature, self.logprob_chunk)
        if name == "entropy":
            return token_entropy(logits, self.temperature, self.logprob_chunk)
        raise ValueError(f"the {self.role} worker computes logprobs or entropy, not '{name}'")

    @torch.no_grad()
    def forward(self, samples: list[Sample], name: str, micro_batches: list[list[int]]) -> list[torch.Tensor]:
        """Per-token ``name`` of every sample (one tensor of its num_targets each): this rank
        computes its ``micro_batches`` (indices into samples), then every rank receives all."""
        mine = {}
        for mb in micro_batches:
            chunk = [samples[i] for i in mb]
            batch = self.model_batch(chunk)
            with self.mode(), self.autocast():
                logits = self.model(**batch.inputs).logits
            rows = batch.repad(self.token_field(name, logits, batch.inputs["input_ids"]))
            for i, row in zip(mb, rows):
                # Kept on the CPU between passes (collate moves them back): a rollout's worth of
                # per-token fields stays off the GPU, and gather pickles CPU tensors.
                mine[i] = row[: samples[i].num_targets].to("cpu", copy=True)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for part in gather(mine):
            for i, row in part.items():
                out[i] = row
        missing = [i for i, row in enumerate(out) if row is None]
        if missing:
            raise RuntimeError(f"the {self.role}'s {name} were computed for no micro-batch holding samples {missing[:8]}")
        return out

    def train_step(self, batch: list, plan: StepPlan, loss_fn: LossFn,
                   before_step: Callable[[list[dict]], None] | None = None) -> StepResult:
        """One optimizer step over ``batch`` (every rank's samples) as ``plan`` lays it out.
        ``before_step(parts)`` sees this rank's micro-batch metrics once all are backpropagated
        and may stop the step before it is applied (the on-policy check does)."""
        total, parts = 0.0, []
        self.engine.begin_step(len(plan.micro_batches))
        for mb in plan.micro_batches:
            loss, share, metrics = loss_fn(self, [batch[i] for i in mb], plan.normalizer)
            self.engine.backward(loss, share, num_samples=len(mb))
            total += loss.item()
            parts.append(metrics)
        if before_step is not None:
            before_step(parts)
        stats = self.engine.step(plan)
        return StepResult(self.engine.sum_over_ranks(total), parts, stats)

    def mean_metrics(self, parts: list[dict[str, float]], skip: tuple[str, ...] = ()) -> dict[str, float]:
        """Per-micro-batch metrics averaged over this rank's micro-batches, then over ranks."""
        keys = [k for k in (parts[0] if parts else {}) if k not in skip]
        return self.engine.mean_over_ranks({k: sum(p[k] for p in parts) / len(parts) for k in keys})

    def export_weights(self, adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's full weights, Hugging Face-named, one tensor at a time, from every
        backend alike (shards and partitions gathered; a LoRA model merged, or with
        ``adapters`` its adapters only). Every rank takes part when the weights are sharded."""
        return self.engine.export_weights(adapters)

    def push_weights(self, generator) -> int:
        """Make ``generator`` sample with this worker's current weights; returns its new version.
        A generator holding this very model object (the in-process HF loop) is handed the
        model's own parameters, which it checks by identity: nothing gathered or copied. Any
        other receives export_weights()."""
        if getattr(generator, "model", None) is self.model:
            return generator.load_weights(self.model.named_parameters())
        return generator.load_weights(self.export_weights())

    def save(self, path: Path, tokenizer) -> Path:
        """The model in Hugging Face format at ``path`` (every rank takes part; the main process writes)."""
        return self.engine.save_pretrained(path, tokenizer)

    def save_state(self, directory: Path, tokenizer, state: dict) -> None:
        """This worker's part of a checkpoint being written (exactrl/distributed/checkpoint.py)."""
        self.engine.save_checkpoint(directory, tokenizer, state)

    def load_state(self, directory: Path, engine_state: dict) -> None:
        """Continue from a checkpoint's part ``directory``: optimizer, scheduler and step (the
        weights were loaded with the model, Worker.build's ``checkpoint``)."""
        self.engine.load_state_dict(engine_state, directory)

    def apply(self, fn: Callable[[torch.nn.Module], object]) -> object:
        """``fn(model)`` where the model lives (here, in this process): for work that needs the
        whole model in place, such as the periodic greedy evaluation."""
        return fn(self.model)
