"""Shared by the RL tests: micro-batch layouts and per-token log-probs attached to samples."""

from __future__ import annotations

from exactrl.workers.worker import Worker


def consecutive(n: int, size: int) -> list[list[int]]:
    """Micro-batches [0, size), [size, 2 size), ... of n samples."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def attach_logprobs(model, samples, field: str, micro_batches, pad_id: int, temperature: float, autocast, packed: bool = True):
    """Each sample's per-token log-probs under ``model`` (Worker.forward, as a run computes
    them) stored as its ``field`` (old_logprobs or ref_logprobs)."""
    worker = Worker("test", model, pad_id=pad_id, packed=packed, temperature=temperature, autocast=autocast)
    for s, logprobs in zip(samples, worker.forward(samples, "logprobs", micro_batches)):
        setattr(s, field, logprobs)
