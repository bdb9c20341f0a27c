"""The channel the policy's weights take from the trainer to the engines: a process group of its
own (the sender 0, then every engine's workers, one per tensor-parallel rank), never the run's
default one, so it can be opened from any process (a torchrun rank, a Ray actor) to any engines.
In a plain run the sender is the engine's client in the trainer's rank 0 (one engine); under Ray
it is the policy's rank 0 itself, one broadcast reaching every engine's workers on any node
(exactrl/workers/groups.py EngineGroup, as OpenRLHF's model-update group).

Its backend is gloo (through host memory: any devices, any placement) or NCCL (device to device:
every member on a GPU of its own, as under Ray's split placement; NCCL refuses two members on one
GPU, which is why an engine that shares the trainer's GPU takes gloo). The protocol is the same;
only the device of its tensors differs.

Protocol, per sync: buckets of whole tensors (up to ``bucket_bytes`` each, one tensor alone when
larger), each as three broadcasts from the trainer: a header [length of the bucket's description,
length of its bytes], the description (JSON: name, dtype, shape, offset of every tensor), the
bytes; then a header [0, 0] ends the sync. Every broadcast waits at most ``timeout`` seconds, so a
peer that never joins (a hung or dead engine) ends the sync with an error instead of a hang.

Only torch and the standard library: the engine's environment imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = torch.device("cpu")  # gloo's tensors


class ChannelTimeout(RuntimeError):
    """A broadcast of the weight channel did not complete in time (or the peer went away)."""


def serve_store(host: str, timeout: float) -> dist.TCPStore:
    """The rendezvous store the trainer (rank 0) serves, on a free port (its ``.port``)."""
    return dist.TCPStore(host, 0, world_size=2, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def join_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """The engine's side of the rendezvous store."""
    return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timedelta(seconds=timeout))


def open_group(store: dist.Store, rank: int, timeout: float, world: int = 2, host: str | None = None,
               backend: str = "gloo") -> dist.ProcessGroup:
    """Rank ``rank`` of the group of ``world`` members over ``store`` (all call it together): the
    sender (0) and the engines' workers. ``host``: the address a gloo member listens on, one the
    others can reach (its node's, when members are on several nodes); by default the one its host
    name resolves to. ``backend`` "nccl": on this process's current CUDA device."""
    prefixed = dist.PrefixStore("exactrl-weights", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    if host is None:
        return dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def device(backend: str) -> torch.device:
    """Where a channel's tensors live: host memory for gloo, this process's GPU for NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else HOST


def _broadcast(group: dist.ProcessGroup, t: torch.Tensor, timeout: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    try:
        group.broadcast([t], opts).wait(timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo reports a timeout, a closed connection, a peer that reset it
        raise ChannelTimeout(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from e


def _header(group, a: int, b: int, timeout: float, on: torch.device) -> None:
    _broadcast(group, torch.tensor([a, b], dtype=torch.int64, device=on), timeout)


def send(group: dist.ProcessGroup, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
         timeout: float, on: torch.device = HOST) -> tuple[int, int]:
    """Broadcast every tensor of ``named`` in buckets, from device ``on`` (device(backend));
    returns (tensors, bytes) sent."""
    bucket, size, tensors, total = [], 0, 0, 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        described, offset = [], 0
        for name, t in bucket:
            described.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            offset += t.numel() * t.element_size()
        blob = torch.frombuffer(bytearray(json.dumps(described).encode()), dtype=torch.uint8).to(on)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        _header(group, blob.numel(), flat.numel(), timeout, on)
        _broadcast(group, blob, timeout)
        _broadcast(group, flat, timeout)
        bucket, size = [], 0

    for name, t in named:
        t = t.detach().to(on).contiguous()
        if size and size + t.numel() * t.element_size() > bucket_bytes:
            flush()
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        tensors, total = tensors + 1, total + t.numel() * t.element_size()
    flush()
    _header(group, 0, 0, timeout, on)
    return tensors, total


def receive(group: dist.ProcessGroup, timeout: float,
            on: torch.device = HOST) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets ``send`` broadcasts, one list of (name, tensor on ``on``) at a time, until the end."""
    while True:
        header = torch.zeros(2, dtype=torch.int64, device=on)
        _broadcast(group, header, timeout)
        n_desc, n_bytes = header.tolist()
        if n_desc == 0:
            return
        blob = torch.empty(n_desc, dtype=torch.uint8, device=on)
        _broadcast(group, blob, timeout)
        flat = torch.empty(n_bytes, dtype=torch.uint8, device=on)
        _broadcast(group, flat, timeout)
        out = []
        for name, dtype, shape, offset in json.loads(blob.cpu().numpy().tobytes()):
            dt = getattr(torch, dtype)
            size = torch.empty(0, dtype=dt).element_size()
            piece = flat[offset : offset + int(torch.Size(shape).numel()) * size]
            if offset % size:  # after a tensor of a smaller dtype: realign before reinterpreting
                piece = piece.clone()
            out.append((name, piece.view(dt).reshape(shape)))
        yield out
