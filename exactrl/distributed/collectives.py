"""Sharing Python objects between ranks: each rank does its contiguous share of a list, then
every rank receives every share in rank order (one process: the list itself)."""

from __future__ import annotations

import torch

from exactrl.distributed.launch import rank, world_size


def shard(items: list) -> list:
    """This rank's contiguous share of ``items`` (their number divides by the world size)."""
    per = len(items) // world_size()
    return items[rank() * per : (rank() + 1) * per]


def gather(obj) -> list:
    """Every rank's ``obj``, in rank order (a one-element list in one process)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def gather_fields(mine: dict[int, list], n: int, names: tuple[str, ...], who: str) -> dict[str, list]:
    """Every rank's ``mine`` (sample index -> its fields, in ``names``' order) joined into each field's list over
    all ``n`` samples; a sample no rank computed is an error naming ``who`` (a layout that missed it)."""
    out: list[list | None] = [None] * n
    for part in gather(mine):
        for i, row in part.items():
            out[i] = row
    missing = [i for i, row in enumerate(out) if row is None]
    if missing:
        raise RuntimeError(f"the {who}'s {', '.join(names)} were computed for no micro-batch holding samples "
                           f"{missing[:8]}")
    return {name: [row[j] for row in out] for j, name in enumerate(names)}
