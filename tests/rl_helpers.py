"""Shared by the SFT and RL tests: micro-batch layouts, per-token log-probs attached to samples,
and one micro-batch's loss through the run's own path (Worker.micro_batch under the SFT or the
algorithm's objective) for tests that inject faults between micro-batches."""

from __future__ import annotations

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.sft import demonstration, sft_objective
from exactrl.losses.objective import Metrics
from exactrl.workers.worker import Worker


def consecutive(n: int, size: int) -> list[list[int]]:
    """Micro-batches [0, size), [size, 2 size), ... of n samples."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def attach_logprobs(model, samples, field: str, micro_batches, pad_id: int, temperature: float, autocast,
                    packed: bool = True):
    """Each sample's per-token log-probs under ``model`` (Worker.forward, as a run computes
    them) stored as its ``field`` (old_logprobs or ref_logprobs)."""
    worker = Worker("test", model, pad_id=pad_id, packed=packed, temperature=temperature, autocast=autocast)
    for s, logprobs in zip(samples, worker.forward(samples, "logprobs", [micro_batches])):
        setattr(s, field, logprobs)


def sft_micro_batch_loss(model, engine, examples, pad_id: int, normalizer, packed: bool = True):
    """(part of the step loss, canary share) of one micro-batch of SFT examples under ``normalizer``."""
    objective = sft_objective(normalizer.mode, normalizer.norm_len)
    worker = Worker("policy", model, engine, pad_id=pad_id, packed=packed)
    loss, share, _ = worker.micro_batch([demonstration(e) for e in examples], objective,
                                        dict.fromkeys(objective.groups(), normalizer), Metrics())
    return loss, share


def policy_micro_batch_loss(model, engine, samples, normalizer, cfg, pad_id: int):
    """(part of the step loss, canary share, metrics) of one micro-batch of RL samples under the
    algorithm's objective; samples without old log-probs take this forward's own (a reused rollout)."""
    objective = ALGORITHMS.lookup(cfg.algo.name).objective(cfg)
    objective = objective.with_term("policy", old="self" if samples[0].old_logprobs is None else "old_logprobs")
    worker = Worker("policy", model, engine, pad_id=pad_id, packed=cfg.train.padding_free,
                    temperature=cfg.rollout.temperature)
    m = Metrics()
    loss, share, _ = worker.micro_batch(samples, objective, dict.fromkeys(objective.groups(), normalizer), m)
    return loss, share, {k: (m.sums[k] / m.counts[k].clamp(min=1)).item() for k in m.sums} | {
        k: v.item() for k, v in m.maxima.items()}
