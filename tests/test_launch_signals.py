"""Stopping and failing a ``distributed.nproc_per_node=2`` run through the real launcher (issue 21):
a signal to the ``exactrl`` process reaches every rank, nothing of the run outlives the launcher
by more than a moment, the exit code and status.json say how it ended, and checkpoints stay
whole; a refusal ends in one line and exit code 2, as with one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from exactrl.distributed.checkpoint import STATE_FILE, complete_checkpoints

psutil = pytest.importorskip("psutil")

TWO_RANKS = ["sft", "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1",
             "distributed.backend=fsdp2", "distributed.nproc_per_node=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "EXACTRL_CACHE": str(tmp_path_factory.mktemp("cache")), "OMP_NUM_THREADS": "1"}


def launch(cwd: Path, env: dict, *overrides: str) -> subprocess.Popen:
    """The launcher, its output in files (a full pipe would stall the ranks' progress lines)."""
    with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "exactrl.cli", *TWO_RANKS, *overrides], cwd=cwd, env=env,
                                stdout=out, stderr=err)


def stderr(proc: subprocess.Popen, cwd: Path, timeout: float) -> str:
    proc.wait(timeout)
    return (cwd / "stderr").read_text()


def watch(proc: subprocess.Popen, seen: dict, until, timeout: float = 300) -> None:
    """Every process below the launcher, into ``seen`` (pid -> psutil.Process, which knows its start time,
    so a reused pid is not mistaken for it), until ``until(seen)`` holds."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            seen.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        if until(seen):
            return
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting (launcher exit code {proc.poll()})")


def alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ranks_started(seen: dict) -> bool:
    return sum(alive(p) and p.cmdline()[1:4] == ["-u", "-m", "exactrl.cli"] for p in seen.values()) == 2


def kill(proc: subprocess.Popen, seen: dict) -> None:
    """After a failed test: nothing of it may run on into the next ones."""
    for p in [psutil.Process(proc.pid), *seen.values()] if proc.poll() is None else seen.values():
        if alive(p):
            p.kill()


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "start-up"), (signal.SIGTERM, "training"),
                                       pytest.param(signal.SIGINT, "start-up", marks=pytest.mark.slow)])
def test_a_signal_stops_every_rank(tmp_path, env, sig, when):
    out = tmp_path / "run"
    proc = launch(tmp_path, env, "train.max_steps=1000", "train.save_every=1", f"output_dir={out}")
    seen = {}
    try:
        if when == "start-up":  # the ranks import torch: no process group, no run directory yet
            watch(proc, seen, ranks_started)
        else:
            watch(proc, seen, lambda _: (out / "checkpoint-1").is_dir())
        proc.send_signal(sig)
        err = stderr(proc, tmp_path, 60)
        time.sleep(1)
        left = [p.pid for p in seen.values() if alive(p)]
        assert not left, left
    finally:
        kill(proc, seen)
    code, line = {signal.SIGTERM: (143, "terminated: SIGTERM"), signal.SIGINT: (130, "interrupted: SIGINT")}[sig]
    assert proc.returncode == code and err.count(line) == 1 and "Traceback" not in err, err[-3000:]
    if when == "start-up":
        assert (not (out / "status.json").exists()
                or json.loads((out / "status.json").read_text())["state"] == "interrupted")
        return
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    for checkpoint in complete_checkpoints(out):  # whole: every file reads
        assert load_file(checkpoint / "model.safetensors")
        assert torch.load(checkpoint / STATE_FILE, weights_only=True)["world_size"] == 2
        for r in (0, 1):
            torch.load(checkpoint / f"rng-rank{r}.pt", weights_only=False)


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("override, expected", [
    ("distributed.device=cuda", "error: distributed.device=cuda, but this torch"),
    ("data.train=empty.jsonl", "error: data file 'empty.jsonl' has no rows"),
])
def test_what_every_rank_would_refuse_is_refused_before_the_start(tmp_path, env, monkeypatch, override, expected):
    """Checked by the launcher, in this process: no torchrun, no rank started."""
    from exactrl.cli import app

    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXACTRL_CACHE", env["EXACTRL_CACHE"])
    result = CliRunner().invoke(app, [*TWO_RANKS, override, "output_dir=run"])
    assert result.exit_code == 2, result.output
    assert one_line(result.output).startswith(expected)


def test_a_refusal_only_a_rank_can_find_is_one_line(tmp_path, env):
    """Found by the ranks (each process's device): their notes become the launcher's one line; torchrun's
    own report (about 40 lines of ChildFailedError) is left out."""
    proc = launch(tmp_path, env, "distributed.fsdp_cpu_offload=true", "output_dir=run")
    err = stderr(proc, tmp_path, 300)
    assert proc.returncode == 2, err[-3000:]
    assert one_line(err).startswith("error: distributed.fsdp_cpu_offload=true offloads from a GPU")


@pytest.mark.slow
def test_a_rank_killed_outright_is_named_as_the_cause(tmp_path, env):
    """kill -9 (or the out-of-memory killer) leaves no note: its peer then fails in a collective, but the
    line and status.json name the killed rank."""
    out = tmp_path / "run"
    proc = launch(tmp_path, env, "train.max_steps=1000", "train.save_every=1", f"output_dir={out}")
    seen = {}
    try:
        watch(proc, seen, lambda _: (out / "checkpoint-1").is_dir())
        next(p for p in seen.values() if alive(p) and p.environ().get("RANK") == "1").kill()
        err = stderr(proc, tmp_path, 60)
    finally:
        kill(proc, seen)
    assert proc.returncode == 1 and "ChildFailedError" not in err, err[-3000:]
    # (the peer's broken collective may print its traceback first, if it gets there before torchrun stops it)
    assert err.strip().splitlines()[-1].startswith("error: rank 1 ended (signal SIGKILL) without saying why")
    assert json.loads((out / "status.json").read_text())["message"].startswith("rank 1 ended (signal SIGKILL)")


def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run():
    """Python drops an exception raised in a __del__: a SIGTERM that arrived during one (seen in a
    regex finalizer mid-rollout) must still stop the run, not be lost."""
    import typer

    from exactrl.cli import _run

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, in this frame

    def train(cfg):
        Finalized()
        deadline = time.time() + 3
        while time.time() < deadline:
            time.sleep(0.01)

    with pytest.raises(typer.Exit) as stopped:
        _run("sft", None, [], train)
    assert stopped.value.exit_code == 143
