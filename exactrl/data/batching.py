"""Right-padding of token lists, and the step sampler."""

from __future__ import annotations

import random

import torch


def pad_right(seqs: list[list[int]], pad_value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [pad_value] * (width - len(s)) for s in seqs], dtype=torch.long)


class StepSampler:
    """Draws the global batch of each optimizer step from an endless stream of shuffled epochs.

    Step k takes positions [k*G, (k+1)*G) of the stream, so the samples of a step depend only
    on the seed and k: never on micro-batch size or world size, and resuming at step k needs
    nothing but k.
    """

    def __init__(self, num_items: int, global_batch_size: int, seed: int):
        self.n, self.g, self.seed = num_items, global_batch_size, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.n))
            random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
            # A step straddles at most two epochs: keep the newest two orders.
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return self._orders[epoch]

    def batch(self, step: int) -> list[int]:
        start = step * self.g
        return [self._order((start + i) // self.n)[(start + i) % self.n] for i in range(self.g)]

    def epoch_of(self, step: int) -> float:
        return step * self.g / self.n
