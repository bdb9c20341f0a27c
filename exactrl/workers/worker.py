"""The worker: one model, the engine that trains it (none for a frozen model) and its device.

Every role of a run (policy, reference, critic, later a reward model) is a worker, built from
the run's config by role, and is driven the same way:

    worker = Worker.build(cfg, "policy", path, ...)              # model, self-checks, engine
    fields = worker.forward(samples, "logprobs", micro_batches)   # per-token, no gradient
    result = worker.train_step(batch, plan, objective)           # one verified optimizer step
    worker.push_weights(generator, check)                        # to a rollout engine, verified
    worker.save(path, tokenizer)                                 # Hugging Face format

Nothing outside a worker needs its model or engine: checkpoints go through ``save_state`` /
``load_state``, a generator receives ``export_weights()``.

``train_step`` is the only place micro-batches are backpropagated. The objective is data
(exactrl/losses/objective.py); per micro-batch of this rank: collate, one forward, the per-token
fields the objective reads, its exact share of every term under the plan's step-wide
normalisers, backward. Then, once per step, one reduction over ranks of the metrics and of
what the backward saw (rows and loss tokens, counted from the tensors that entered the loss,
against the plan's step-wide counts), the objective's declared on-policy check, and the
engine's canary and optimizer step. ``forward`` computes a per-token field for this rank's micro-batches and
hands every rank every sample's values, so per-token fields computed once per rollout (old
log-probs, reference log-probs, values) are the same on every rank.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from exactrl.checks.weight_sync import Digesting, SyncCheck, SyncReport, probe_ids
from exactrl.data.batch import Sample, collate
from exactrl.device import process_device, to_device
from exactrl.distributed.collectives import gather_fields
from exactrl.distributed.engine import SampleAccountingError, build_engine
from exactrl.distributed.launch import rank, world_size
from exactrl.distributed.step_plan import StepPlan
from exactrl.dtypes import autocast_for
from exactrl.losses.objective import Metrics, Objective, micro_batch_loss
from exactrl.losses.token_losses import kept_logprobs, token_entropy, token_logprobs
from exactrl.models import head
from exactrl.models.lora import reference_mode
from exactrl.models.packing import model_batch
from exactrl.rollout.hf import base_model
from exactrl.workers.load import check_generator, load_model

# role -> the worker class that builds it, as "module:Class" (imported when a run asks for the
# role, as the engines are): a reward model joins with one row.
ROLES = {
    "policy": "exactrl.workers.worker:Worker",
    "reference": "exactrl.workers.worker:Worker",
    "critic": "exactrl.workers.critic:Critic",
    "reward_model": "exactrl.workers.reward_model:RewardModel",
    "reward": "exactrl.workers.reward_model:RewardModel",  # a trained reward model, frozen: exactrl rl's reward.model
    "teacher": "exactrl.workers.teacher:Teacher",  # a distillation teacher, frozen: exactrl rl's distill.teacher
}


@dataclass
class StepResult:
    loss: float  # the step's loss, summed over micro-batches and ranks
    metrics: dict[str, float] = field(default_factory=dict)  # over the step: means over its loss tokens, maxima
    stats: dict = field(default_factory=dict)  # the engine's: grad_norm, lr, canary, micro-batches, samples...


class Worker:
    """``role``'s model; ``engine`` trains it (None: frozen, forward only); forwards run under
    ``autocast`` (the engine's, else the one given); sequences are packed when ``packed``."""

    def __init__(self, role: str, model: torch.nn.Module, engine=None, *, pad_id: int, packed: bool = True,
                 temperature: float = 1.0, autocast: Callable | None = None, logprob_chunk: int | None = None,
                 mode: Callable | None = None, top_p: float = 1.0, top_k: int = 0):
        self.role, self.model, self.engine = role, model, engine
        self.pad_id, self.packed, self.temperature = pad_id, packed, temperature
        self.top_p, self.top_k = top_p, top_k  # the sampling cut kept_logprobs replays
        self.autocast = autocast or (engine.autocast if engine is not None else contextlib.nullcontext)
        self.logprob_chunk = logprob_chunk if logprob_chunk is not None else getattr(engine, "logprob_chunk", 0)
        self.mode = mode or contextlib.nullcontext  # entered around forward: e.g. LoRA's adapters off for the reference

    @property
    def rank(self) -> int:
        return self.engine.rank if self.engine is not None else rank()

    @property
    def world_size(self) -> int:
        """The ranks this worker's role runs on (its process group's, a frozen worker's too)."""
        return self.engine.world_size if self.engine is not None else world_size()

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
        # The log-probs of an RL run are those of its sampling temperature (and top-p/top-k kept set, when replayed).
        sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k} if hasattr(cfg, "rollout") else {}
        packed = cfg.train.padding_free
        if role == "policy":
            model = load_model(cfg, path, run_dir, phase, "policy", longest, checkpoint=checkpoint)
            return cls("policy", model, build_engine(model, cfg, total_steps), pad_id=pad_id, packed=packed,
                       **sampling)
        # The reference computes as the policy does: under the run's autocast, in its log-prob chunks.
        device, dtype = process_device(), cfg.model.dtype
        common = {"pad_id": pad_id, "packed": packed, **sampling, "logprob_chunk": cfg.train.logprob_chunk_size,
                  "autocast": lambda: autocast_for(dtype, device)}
        if cfg.model.lora.rank > 0:
            if policy is None:
                raise ValueError("with LoRA the reference is the policy's own model (its adapters off): build it after "
                                 "the policy, in the policy's process")
            return cls("reference", policy.model, mode=lambda: reference_mode(policy.model), **common)
        return cls("reference", load_model(cfg, path, run_dir, phase, "reference", longest, trainable=False), **common)

    def model_batch(self, samples: list[Sample]):
        return model_batch(self.model, [s.ids for s in samples], self.pad_id, self.packed)

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-token ``name`` [rows, L-1] from one forward's logits (packed or padded rows)."""
        if name == "logprobs":
            return token_logprobs(logits, input_ids, self.temperature, self.logprob_chunk)
        if name == "kept_logprobs":
            return kept_logprobs(logits, input_ids, self.temperature, self.top_p, self.top_k, self.logprob_chunk)
        if name == "entropy":
            return token_entropy(logits, self.temperature, self.logprob_chunk)
        if name == "logits":  # [rows, L-1, vocabulary], each target's predicting logits (a divergence over them)
            return logits[:, :-1]
        raise ValueError(f"the {self.role} worker computes logprobs, kept_logprobs, entropy or logits, not '{name}'")

    @contextlib.contextmanager
    def per_token_head(self, batch, trained: tuple[str, ...], metrics: tuple[str, ...]):
        """Around one forward of ``batch``: gives a function from the forward's ``.logits`` to the
        fields ``trained`` (with their graph) and ``metrics`` (without), each [rows, L-1]. Through
        the chunked head (exactrl/models/head.py) when every field is one it computes, the run
        chunks (train.logprob_chunk_size) and the model's head passed its self-check; else from
        the model's full logits (token_field)."""
        names, ids = trained + metrics, batch.inputs["input_ids"]
        if self.logprob_chunk > 0 and names and set(names) <= set(head.FIELDS) and head.can_chunk(self.model):
            sampling = head.Sampling(self.temperature, self.top_p, self.top_k)
            with head.per_token_head(self.model, ids, trained, metrics, sampling, self.logprob_chunk):
                yield lambda output: {name: output[..., i] for i, name in enumerate(names)}
            return

        def from_logits(logits):
            out = {}
            for name in names:
                with torch.set_grad_enabled(name in trained):
                    out[name] = self.token_field(name, logits, ids)
            return out

        yield from_logits

    def forward(self, samples: list[Sample], name: str, layout: list[list[list[int]]]) -> list[torch.Tensor]:
        """Per-token ``name`` of every sample (one tensor of its num_targets each): this rank
        computes its micro-batches ``layout[rank]`` (indices into samples), then every rank receives
        all. Every rank takes the same arguments (a group of Ray actors is called so)."""
        return self.forward_fields(samples, (name,), layout)[name]

    @torch.no_grad()
    def forward_fields(self, samples: list[Sample], names: tuple[str, ...],
                       layout: list[list[list[int]]]) -> dict[str, list[torch.Tensor]]:
        """``forward`` of several per-token fields from one forward per micro-batch."""
        if len(layout) != self.world_size:
            raise ValueError(f"a layout of {len(layout)} ranks' micro-batches for the {self.role}'s {self.world_size}")
        mine = {}
        for mb in layout[self.rank]:
            chunk = [samples[i] for i in mb]
            batch = self.model_batch(chunk)
            with self.mode(), self.autocast(), self.per_token_head(batch, (), names) as fields:
                output = self.model(**batch.inputs).logits
            rows = [batch.repad(field) for field in fields(output).values()]
            for j, i in enumerate(mb):
                # Kept on the CPU between passes (collate moves them back): a rollout's worth of
                # per-token fields stays off the GPU, and gather pickles CPU tensors.
                mine[i] = [values[j][: samples[i].num_targets].to("cpu", copy=True) for values in rows]
        return gather_fields(mine, len(samples), names, self.role)

    def micro_batch(self, samples: list[Sample], objective: Objective, normalizers: dict, metrics: Metrics,
                    mean_of: int | None = None):
        """One micro-batch: its part of the step loss (not yet backpropagated), its canary
        share, and the loss mask that entered the loss. ``mean_of``: the step's micro-batches when
        each is normalised by its own counts (StepPlan.micro_means, fault.mean_of_means;
        exactrl/losses/objective.py micro_batch_loss)."""
        on_cpu = collate(samples, self.pad_id)
        b = {k: to_device(v, self.engine.device) for k, v in on_cpu.items()}
        mb = self.model_batch(samples)
        names = objective.fields()  # a field only a metric reads is computed without a graph
        trains = tuple(n for n in names if any(n in t.fields for t in objective.terms) and torch.is_grad_enabled())
        with self.autocast(), self.per_token_head(mb, trains, tuple(n for n in names if n not in trains)) as made:
            output = self.engine.forward(self.model, **mb.inputs).logits
        fields = {name: mb.repad(value) for name, value in made(output).items()}
        # the canary share from the CPU copy of the mask: no device-to-host copy per micro-batch
        loss, share = micro_batch_loss(objective, fields, b, on_cpu, [s.source for s in samples], normalizers, metrics,
                                       mean_of)
        return loss, share, b["loss_mask"]

    def train_step(self, batch: list[Sample], plan: StepPlan, objective: Objective) -> StepResult:
        """One optimizer step over ``batch`` (every rank's samples) as ``plan`` lays it out,
        minimising ``objective``; this rank runs ``plan.for_rank(rank)``."""
        mine = plan.for_rank(self.engine.rank)
        objective = objective.at(self.engine.step_count)
        normalizers, metrics = objective.normalizers(plan), Metrics()
        if self.engine.mean_of_means:  # fault.mean_of_means: every rank's micro-batches, as OpenRLHF averaged them
            plan = replace(plan, micro_means=True)
        mean_of = plan.mean_of()
        self.engine.begin_step(len(mine.micro_batches))  # where the engine's accumulation boundary is
        dev = self.engine.device
        total, rows, tokens = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(3))
        for mb in mine.micro_batches:
            loss, share, mask = self.micro_batch([batch[i] for i in mb], objective, normalizers, metrics, mean_of)
            self.engine.backward(loss, share, num_samples=mask.size(0))
            total, rows, tokens = total + loss.detach().double(), rows + mask.size(0), tokens + mask.sum()
        means, maxima = list(metrics.sums), list(metrics.maxima)
        summed = torch.stack([total, rows, tokens, *metrics.sums.values(), *metrics.counts.values()])
        peak = torch.stack(list(metrics.maxima.values())) if maxima else None
        if self.engine.world_size > 1:  # the step's only reductions of its metrics, one of each kind
            torch.distributed.all_reduce(summed)
            if peak is not None:
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        summed, peak = summed.tolist(), [] if peak is None else peak.tolist()
        loss, seen = summed[0], (int(summed[1]), int(summed[2]))
        if seen != (plan.num_samples, plan.count()[0]):
            raise SampleAccountingError(
                f"step {self.engine.step_count}: the plan has {plan.num_samples} samples / {plan.count()[0]} loss "
                f"tokens, the {self.role}'s losses saw {seen[0]} / {seen[1]} over all ranks")
        n = len(means)
        out = {k: s / max(c, 1.0) for k, s, c in zip(means, summed[3 : 3 + n], summed[3 + n :])} | dict(zip(
            maxima, peak))
        if objective.on_policy is not None:  # before the step is applied
            objective.on_policy.verify(out["ratio_dev"])
        return StepResult(loss, out, self.engine.step(mine))

    def export_weights(self, adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's full weights, Hugging Face-named, one tensor at a time, from every
        backend alike (shards and partitions gathered; a LoRA model merged, or with
        ``adapters`` its adapters only). Every rank takes part when the weights are sharded."""
        return self.engine.export_weights(adapters)

    def push_weights(self, generator, check: SyncCheck | None = None) -> SyncReport | None:
        """Make ``generator`` sample with this worker's current weights, verified
        (exactrl/checks/weight_sync.py): the generator's digest of what it now holds must equal
        the digest of what was sent, and its log-probs of the probe sequence this worker's.
        A generator holding this very model object (the in-process HF loop) is handed the
        model's own parameters, which it checks by identity: nothing gathered or copied, and the
        digest computed once (both sides hold the same tensors). Any other receives
        export_weights(), digested as it passes. Every rank takes part; a generator that only
        rank 0 sends to (the Ray engine group, ``rank0_sends``: load_weights gives the other
        ranks None, and they digest nothing) is verified there, and the other ranks return None."""
        check, t0 = check or SyncCheck(), time.perf_counter()
        if getattr(generator, "model", None) is self.model:
            version = generator.load_weights(self.model.named_parameters())
            sent = generator.weights_digest()
            held = [(generator.name, sent)]
        else:  # in the dtype the generator holds them (vLLM in bf16 from an fp32 trainer), digested as sent
            dtype = getattr(generator, "weights_dtype", None)
            named = ((n, t if dtype is None else t.to(dtype)) for n, t in self.export_weights())
            if getattr(generator, "rank0_sends", False) and self.rank != 0:  # this rank only takes part in the gathers
                version = generator.load_weights(named)
            else:
                stream = Digesting(named)
                version = generator.load_weights(stream)
                sent = stream.digest()
                # a group of engines (Ray's) gives each one's digest, checked by its name
                held = generator.engine_digests() if hasattr(generator, "engine_digests") else [
                    (generator.name, generator.weights_digest())]
        ids = probe_ids(base_model(self.model).config.vocab_size, avoid=(self.pad_id,))
        mine = self.probe_logprobs(ids)  # every rank: a sharded model's forward runs on all of them
        if version is None:
            return None
        for name, loaded in held:
            check.digests(name, version, sent, loaded)
        error = check.probe(generator.name, version, mine, generator.probe_logprobs(ids))
        return SyncReport(version, held[0][1].value, time.perf_counter() - t0, error, len(sent.tensors))

    @torch.no_grad()
    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[t] | ids[:t]), t >= 1, at temperature 1, from this worker's forward (the weight-sync probe)."""
        batch = self.model_batch([Sample(ids[:1], ids[1:])])
        with self.mode(), self.autocast():
            logits = self.model(**batch.inputs).logits
        return batch.repad(token_logprobs(logits, batch.inputs["input_ids"], 1.0))[0, : len(ids) - 1]

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

    def apply(self, fn: Callable[..., object], *args, **kwargs) -> object:
        """``fn(model, *args, **kwargs)`` where the model lives (here, in this process; on every rank of
        a Ray actor group, which then pickles ``fn``: a module-level function): for work that needs the
        whole model in place, such as the periodic greedy evaluation."""
        return fn(self.model, *args, **kwargs)

    def check_generation(self, cfg, tokenizer, run_dir: Path, phase: str, *, sampled: bool) -> None:
        """The generation self-check on this worker's model (exactrl/workers/load.py), every rank together."""
        check_generator(cfg, self.model, tokenizer, run_dir, phase, sampled=sampled,
                        synced=self.engine.synced_decoding)

    def canary_summary(self) -> dict | None:
        """What the canary of this worker's engine made of the run so far (None: no canary)."""
        canary = getattr(self.engine, "canary", None)
        return None if canary is None else {"policy": canary.policy, "steps_flagged": canary.fired}
