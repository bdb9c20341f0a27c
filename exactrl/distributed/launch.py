"""Process groups and launching: one process by default, torchrun for data parallelism.

``distributed.nproc_per_node=N`` makes ``exactrl <command>`` re-run itself under torchrun
(``python -m torch.distributed.run``); running under torchrun (or the DeepSpeed launcher)
directly works the same, on one machine or many:

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m exactrl.cli sft --config my.yaml distributed.backend=fsdp2
    deepspeed --num_gpus 8 --module exactrl.cli sft --config my.yaml distributed.backend=deepspeed
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from exactrl.device import process_device, process_group_backend


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def is_main() -> bool:
    return rank() == 0


def single_process_env() -> None:
    """The rendezvous variables a launcher would set, for one process started without one
    (a free local port, so concurrent runs do not collide)."""
    if under_launcher():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)


def init_process_group() -> None:
    """gloo on CPU, NCCL on GPUs (this process's device, exactrl/device.py, which
    also selects the rank's GPU); idempotent; works without a launcher (world size 1)."""
    if not dist.is_initialized():
        single_process_env()
        dist.init_process_group(process_group_backend(process_device()))


def shutdown() -> None:
    """Leave the process group together: all ranks wait for each other, then tear it down.
    (A rank that exits while a peer is still busy can abort in gloo's teardown with
    "terminate called without an active exception".)"""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_str(text: str) -> str:
    """The main process's ``text`` on every rank (e.g. the run directory it created)."""
    if not dist.is_initialized():
        init_process_group()
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def relaunch_under_torchrun(nproc: int) -> int:
    """Run this same command line as ``nproc`` processes; returns torchrun's exit code."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "exactrl.cli", *sys.argv[1:]]
    return subprocess.call(cmd)
