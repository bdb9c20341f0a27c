"""Run directories: claimed atomically, a status.json saying how each run ended, and a
directory whose run failed before it saved or logged anything does not block the next run."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from exactrl import run_dir
from exactrl.config import SFTConfig, load_config
from exactrl.config.loader import ConfigError

CFG = load_config(SFTConfig, None, [])


@pytest.fixture(autouse=True)
def fresh():
    run_dir.forget_current()
    yield
    run_dir.forget_current()


def test_new_run_dir_has_config_and_running_status(tmp_path):
    path = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml", "status.json"]
    status = run_dir.read_status(path)
    assert status["state"] == "running" and status["pid"] == os.getpid() and status["command"] == "sft"
    run_dir.set_status("error", "boom")
    assert run_dir.read_status(path)["state"] == "error" and run_dir.read_status(path)["message"] == "boom"


def test_two_claims_of_one_directory_one_wins(tmp_path):
    target, results = str(tmp_path / "r"), []

    def claim():
        try:
            run_dir._claim(run_dir.Path(target))
            results.append("won")
        except ConfigError:
            results.append("refused")

    (tmp_path / "r").mkdir()
    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused"] * 7 + ["won"]


def test_two_continuations_of_an_ended_run_one_wins_and_nothing_is_lost(tmp_path):
    path = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    (path / "checkpoint-2").mkdir()
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    run_dir.set_status("interrupted", "SIGTERM")
    run_dir.forget_current()
    results = []

    def claim():
        try:
            results.append("won" if run_dir._claim(path, continues=True) else "fresh")
        except ConfigError:
            results.append("refused")

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused"] * 7 + ["won"]
    assert (path / "checkpoint-2").is_dir() and (path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_failed_empty_attempt_is_reused_but_a_run_with_results_is_not(tmp_path):
    first = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    (first / "manifest.json").write_text("{}")
    (first / "metrics.jsonl").touch()
    run_dir.set_status("error", "data.train: missing")
    run_dir.forget_current()
    again = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    assert again == first and run_dir.read_status(again)["state"] == "running"
    assert sorted(p.name for p in again.iterdir()) == ["config.yaml", "status.json"]

    (again / "checkpoint-5").mkdir()
    run_dir.set_status("interrupted", "SIGTERM")
    run_dir.forget_current()
    with pytest.raises(ConfigError, match=r"already holds a run \(its run ended 'interrupted': SIGTERM\)"):
        run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    assert (again / "checkpoint-5").is_dir()


@pytest.mark.parametrize("state", ["success", "running"])
def test_a_finished_or_live_run_is_never_reused(tmp_path, state):
    path = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    run_dir.set_status(state)
    run_dir.forget_current()
    with pytest.raises(ConfigError, match="already holds a run"):
        run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    assert run_dir.read_status(path)["state"] == state


def test_a_killed_run_that_left_nothing_is_reused(tmp_path):
    path = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    status = json.loads((path / "status.json").read_text())
    # kill -9: no process, still 'running'
    (path / "status.json").write_text(json.dumps({**status, "pid": 2**22 + 12345}))
    run_dir.forget_current()
    assert run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG) == path


def test_a_directory_without_status_is_refused_with_what_to_do(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").touch()  # what an older exactrl left after a crash
    with pytest.raises(ConfigError, match="no status.json.*delete it if it holds nothing you need"):
        run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)


def test_output_dir_that_is_a_file_or_unwritable(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ConfigError, match="it \\(or a parent\\) is a file, not a directory"):
        run_dir.create_run_dir(str(tmp_path / "f"), "sft", CFG)
    with pytest.raises(ConfigError, match="it \\(or a parent\\) is a file, not a directory"):
        run_dir.create_run_dir(str(tmp_path / "f" / "r"), "sft", CFG)
    assert (tmp_path / "f").read_text() == "mine"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(ConfigError, match="cannot create the run directory \\(Permission denied\\)"):
            run_dir.create_run_dir(str(locked / "r"), "sft", CFG)
    finally:
        locked.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("how", ["kill -9", "live", "success"])
def test_a_continuation_takes_over_a_killed_run_but_not_a_live_or_finished_one(tmp_path, how):
    path = run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG)
    (path / "checkpoint-2").mkdir()
    if how == "success":
        run_dir.set_status("success")
    status = json.loads((path / "status.json").read_text())
    if how == "kill -9":  # no process left, status still 'running'
        (path / "status.json").write_text(json.dumps({**status, "pid": 2**22 + 12345}))
    run_dir.forget_current()
    if how == "kill -9":
        assert run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG, continues=True) == path
        assert (path / "checkpoint-2").is_dir() and run_dir.read_status(path)["pid"] == os.getpid()
    else:
        with pytest.raises(ConfigError, match="already holds a run"):
            run_dir.create_run_dir(str(tmp_path / "r"), "sft", CFG, continues=True)
        assert run_dir.read_status(path)["state"] == status["state"]
