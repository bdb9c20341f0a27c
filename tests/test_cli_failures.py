"""What a new user hits, through the real entry point: each bad input or fault ends in one
line naming the file, line or key, the documented exit code, a status.json saying how the run
ended, and nothing of the user's lost."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from typer.testing import CliRunner

from exactrl.config import DemoConfig, load_config

TINY = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4"]


class Result:
    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr


def exactrl(args, cwd, cache, **kw):
    """The CLI in this process (its code path, exit code and messages; seconds instead of the
    ~12 s a fresh interpreter takes to import torch and transformers here)."""
    from exactrl.cli import app

    old = os.environ.get("EXACTRL_CACHE")
    os.environ["EXACTRL_CACHE"] = str(cache)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(here)
        if old is None:
            os.environ.pop("EXACTRL_CACHE")
        else:
            os.environ["EXACTRL_CACHE"] = old
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.output)


def one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(("error:", "stopped:", "stopped by",
                                                                     "terminated:"))]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_non_finite_training_exits_4_and_records_it(tmp_path, cache):
    out = tmp_path / "run"
    proc = exactrl(["sft", *TINY, "train.max_steps=3", "optim.lr=1e38", "train.max_grad_norm=0", f"output_dir={out}"],
                   tmp_path, cache)
    line = one_line_error(proc, 4)
    assert line.startswith("stopped: optimizer step 2: the gradient norm is nan, so the step was not applied"), line
    assert json.loads((out / "status.json").read_text())["state"] == "nonfinite"
    events = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "nonfinite"]
    assert len(events) == 1 and events[0]["step"] == 2
    assert not (out / "final").exists()


def test_non_finite_config_value_is_one_line(tmp_path, cache):
    proc = exactrl(["sft", "optim.lr=inf", f"output_dir={tmp_path / 'r'}"], tmp_path, cache)
    assert proc.returncode == 2 and "optim.lr: Input should be a finite number (given: 'inf')" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_corrupt_safetensors_is_one_line_and_the_run_dir_is_reusable(tmp_path, cache, monkeypatch):
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(cache))
    model = tmp_path / "model"
    shutil.copytree(ensure_builtin(BuiltinSpec()).model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = tmp_path / "run"
    proc = exactrl(["sft", *TINY, "train.max_steps=1", f"model.path={model}", f"output_dir={out}"], tmp_path, cache)
    line = one_line_error(proc, 2)
    assert f"cannot load the model in '{model}'" in line and "deserializing header" in line, line
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "error" and "cannot load the model" in status["message"]
    # The failed attempt holds nothing of value: the same output_dir works once the model is fixed.
    shutil.copy(ensure_builtin(BuiltinSpec()).model / "model.safetensors", weights)
    proc = exactrl(["sft", *TINY, "train.max_steps=1", f"model.path={model}", f"output_dir={out}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "status.json").read_text())["state"] == "success"


def test_output_dir_that_is_a_file(tmp_path, cache):
    target = tmp_path / "taken"
    target.write_text("my notes")
    proc = exactrl(["sft", *TINY, "train.max_steps=1", f"output_dir={target}"], tmp_path, cache)
    assert "it (or a parent) is a file, not a directory" in one_line_error(proc, 2)
    assert target.read_text() == "my notes"


@pytest.mark.slow
def test_sigterm_is_recorded_and_exits_143(tmp_path, cache):
    """A real process and a real signal (23 s here, mostly the interpreter's imports)."""
    out = tmp_path / "run"
    env = {**os.environ, "EXACTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "exactrl.cli", "sft", *TINY, "train.max_steps=100000",
                             "train.log_every=1",
                             f"output_dir={out}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "terminated: SIGTERM" in err and "Traceback" not in err
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["message"].startswith("SIGTERM")


def test_sigint_is_recorded_and_exits_130(tmp_path, cache, monkeypatch):
    from exactrl.workers import worker

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(worker, "build_engine", interrupted)  # Ctrl-C while the model loads
    out = tmp_path / "run"
    proc = exactrl(["sft", *TINY, "train.max_steps=1", f"output_dir={out}"], tmp_path, cache)
    assert proc.returncode == 130 and "interrupted: SIGINT" in proc.stderr
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"


def test_full_disk_is_one_line_and_recorded(tmp_path, monkeypatch, cache):
    from exactrl.distributed import engine

    def no_space(self, path, tokenizer):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(engine.SingleEngine, "save_pretrained", no_space)
    out = tmp_path / "run"
    line = one_line_error(exactrl(["sft", *TINY, "train.max_steps=1", f"output_dir={out}"], tmp_path, cache), 2)
    assert line == (f"error: No space left on device '{out / 'final'}'; free space or fix the permissions, "
                    "then run again")
    assert json.loads((out / "status.json").read_text())["state"] == "error"


def test_canary_stop_exits_3_and_is_recorded(tmp_path, monkeypatch, cache):
    from exactrl.checks.canary import CanaryError
    from exactrl.distributed import engine

    def stopped(self, plan):
        raise CanaryError("canary failed at optimizer step 0: injected")

    monkeypatch.setattr(engine.SingleEngine, "step", stopped)
    out = tmp_path / "run"
    proc = exactrl(["sft", *TINY, "train.max_steps=1", f"output_dir={out}"], tmp_path, cache)
    assert proc.returncode == 3 and "stopped by the canary: canary failed at optimizer step 0: injected" in proc.stderr
    assert json.loads((out / "status.json").read_text())["state"] == "canary"


def test_replaying_a_run_with_an_explicit_output_dir(tmp_path, cache):
    out = tmp_path / "mine"
    assert exactrl(["sft", *TINY, "train.max_steps=1", f"output_dir={out}"], tmp_path, cache).returncode == 0
    saved = (out / "config.yaml").read_text()
    proc = exactrl(["sft", "--config", str(out / "config.yaml")], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    replays = [p for p in tmp_path.iterdir() if p.name.startswith("mine-replay-")]
    assert len(replays) == 1 and (replays[0] / "final" / "model.safetensors").exists()
    replayed = yaml.safe_load((replays[0] / "config.yaml").read_text())
    assert {**replayed, "output_dir": None} == {**yaml.safe_load(saved), "output_dir": None}
    assert (out / "config.yaml").read_text() == saved


def test_progress_off_a_terminal_is_plain_lines(tmp_path, cache):
    proc = exactrl(["sft", *TINY, "train.max_steps=2", f"output_dir={tmp_path / 'r'}"], tmp_path, cache)
    assert proc.returncode == 0 and "\r" not in proc.stderr
    assert "sft: step 2/2 (100%)" in proc.stderr


def test_help_and_version():
    from exactrl import __version__
    from exactrl.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).output.strip() == f"exactrl {__version__}"
    top = runner.invoke(app, ["--help"], terminal_width=80).output
    assert "gspo" in top  # the rl line lists every algorithm rather than ending at its first sentence
    demo = runner.invoke(app, ["demo", "--help"], terminal_width=200).output
    example = demo.split("Dotted overrides, e.g.", 1)[1].split("│")[0].split()
    assert example and load_config(DemoConfig, None, example)  # the example the help shows is accepted


def test_tables_off_a_terminal_are_not_wrapped_at_80_columns():
    from exactrl.cli import _stdout_console

    assert _stdout_console().width == 160  # pytest captures stdout: not a terminal


def test_plain_progress_lines():
    import io

    from exactrl.progress import PlainProgress

    out = io.StringIO()
    bar = PlainProgress(4, "sft", start=1, every_s=3600, file=out)
    bar.set_postfix(loss="0.5")
    for _ in range(3):
        bar.update(1)
    bar.write("[sft] step 4: eval")
    lines = out.getvalue().splitlines()  # one line at the end (the period is an hour), then the message
    assert len(lines) == 2 and lines[0].startswith("sft: step 4/4 (100%), ") and lines[0].endswith("ETA 0 s, loss=0.5")
    assert "\r" not in out.getvalue()


def test_dynamic_sampling_that_cannot_fill_its_rollout_is_one_line(tmp_path, cache):
    """DAPO's dynamic sampling with every group flat (a reward that scores all alike) runs out of
    refill rounds: a problem of the task or its settings, said in one line, not a traceback."""
    out = tmp_path / "dapo"
    proc = exactrl(["rl", "model.path=builtin", "data.eval=null", "algo.name=dapo", "algo.group_size=2",
                    "algo.dapo.max_refill_rounds=0", "train.global_batch_size=4", "train.micro_batch_size=2",
                    "train.max_steps=1", "rollout.max_new_tokens=4", "reward.fn=reward_fixtures:one",
                    f"output_dir={out}"], tmp_path, cache)
    line = one_line_error(proc, 2)
    assert line.startswith("error: dynamic sampling kept 0 of 2 groups after algo.dapo.max_refill_rounds=0"), line
