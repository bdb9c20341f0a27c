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
