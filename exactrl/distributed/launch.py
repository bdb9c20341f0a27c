"""Process groups and launching: one process by default, torchrun for data parallelism.

``distributed.nproc_per_node=N`` makes ``exactrl <command>`` re-run itself under torchrun
(``python -m torch.distributed.run``); running under torchrun (or the DeepSpeed launcher)
directly works the same, on one machine or many:

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m exactrl.cli sft --config my.yaml distributed.backend=fsdp2
    deepspeed --num_gpus 8 --module exactrl.cli sft --config my.yaml distributed.backend=deepspeed
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from exactrl.device import process_device, process_group_backend
from exactrl.run_dir import LAUNCH_DIR


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
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
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


def end_rank() -> None:
    """End this rank of a multi-process run once it has succeeded and left the process group
    (``shutdown``): output flushed, then os._exit(0), skipping the interpreter's finalization.
    There, objects still holding a gloo process group (DeepSpeed keeps references to its groups)
    are destroyed while gloo's worker threads are alive, and the rank can abort with SIGABRT
    ("terminate called without an active exception"), turning a finished run into a failed one
    (seen here about once in 20 two-rank DeepSpeed runs; pytorch PR #179291, abandoned, tried an
    atexit hook). Nothing happens in one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def broadcast_str(text: str) -> str:
    """The main process's ``text`` on every rank (e.g. the run directory it created)."""
    if not dist.is_initialized():
        init_process_group()
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# After SIGINT/SIGTERM the ranks get this long to stop at their next safe point and record how they
# ended; then whatever is left of the run (torchrun, ranks, their reward processes) is killed.
STOP_GRACE = 5.0
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
LAUNCHER_PID = "EXACTRL_LAUNCHER_PID"


def relaunch_under_torchrun(nproc: int, notes: Path) -> int:
    """Run this same command line as ``nproc`` processes under torchrun; returns its exit code.

    torchrun runs in a session of its own, so a Ctrl-C at the terminal reaches it once, from here.
    On SIGINT/SIGTERM here (KeyboardInterrupt or the caller's exception, raised out of the wait)
    torchrun gets SIGTERM and passes it to every rank's process group (rank and reward processes);
    after STOP_GRACE seconds the rest is killed and the exception goes on. SIGTERM for both: a rank
    still importing dies of it quietly, where SIGINT would print a KeyboardInterrupt traceback; the
    caller records which signal it was. (The old ``subprocess.call`` SIGKILLed torchrun at once, so
    the ranks never heard and ran on, orphaned.)
    ``notes`` is where the ranks tell this process their run directory and how they ended."""
    import subprocess

    cmd = [sys.executable, "-m", "exactrl.distributed.torchrun", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "exactrl.cli", *sys.argv[1:]]
    # A signal while Popen runs would leave torchrun started but unknown to us: hold it until proc is set
    # (torchrun inherits the mask and lifts it itself, exactrl/distributed/torchrun.py).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, LAUNCH_DIR: str(notes), LAUNCHER_PID: str(os.getpid())},
                                start_new_session=True)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a held signal is raised here, inside the try
        return proc.wait()
    except BaseException:
        _stop(proc)
        raise


def _stop(proc) -> None:
    seen = _descendants(proc.pid)
    proc.terminate()
    deadline = time.monotonic() + STOP_GRACE
    try:  # a second Ctrl-C ends the wait, not the clean-up
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _descendants(proc.pid)  # ranks leave torchrun's tree when it exits before them
            time.sleep(0.1)
    finally:
        seen |= _descendants(proc.pid)
        proc.kill()
        proc.wait()
        now = _processes()
        for pid, started in seen:
            if now.get(pid, (None, None))[1] == started:  # the same process, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process (Linux /proc; empty elsewhere)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[19])
    return table


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below ``root``."""
    children: dict[int, list[int]] = {}
    table = _processes()
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.add((pid, table[pid][1]))
        todo += children.get(pid, [])
    return found
