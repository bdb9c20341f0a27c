"""Every way a run ends goes through exactrl/run/exits.py's table: each error it lists ends `_run` with the code,
console line and status.json this test expects (written out here as the except chain had them before the table),
and the table lists no error this test does not, so docs/exit-codes.md (generated from it) covers every code."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import typer

from exactrl.run import exits

SELF_CHECK, CANARY = (3, "check", "stopped by a self-check"), (3, "canary", "stopped by the canary")
INPUT, FAILED = (2, "error", "error"), (1, "error", "error")
EXPECTED = {  # the error's class name -> (exit code, status.json state, the line's label)
    **dict.fromkeys(["ConfigError", "DataError", "ModelLoadError", "RewardError", "RemoteRewardError",
                     "ServerUnreachable", "CheckpointError", "RolloutError", "DeviceError", "EngineStartError",
                     "EnvError", "RenderError", "OSError"], INPUT),
    **dict.fromkeys(["PackingCheckError", "GenerationCheckError", "DeterminismError", "OnPolicyCheckError",
                     "WeightSyncError", "StaleRolloutError", "TrajectoryError"], SELF_CHECK),
    **dict.fromkeys(["EvaluationError", "StudyIncomplete", "RoleDied", "GeneratorError"], FAILED),
    "CanaryError": CANARY,
    "NonFiniteError": (4, "nonfinite", "stopped"),
    "KeyboardInterrupt": (130, "interrupted", "interrupted"),
    "Terminated": (143, "interrupted", "terminated"),
}
ROOT = Path(__file__).resolve().parents[1]


def _classes():
    return {path.split(":")[1]: exits._resolve(path) for end in exits.ENDS for path in end.errors}


def _end_of(error: BaseException, tmp_path: Path, capsys) -> tuple[int, str, dict]:
    """Run `exactrl sft` through cli._run with a step that raises ``error`` once its run directory exists:
    its exit code, its console output and its status.json."""
    from exactrl.cli import _run
    from exactrl.run_dir import create_run_dir, read_status

    out = tmp_path / "run"

    def step(cfg):
        create_run_dir(cfg.output_dir, "sft", cfg)
        raise error

    with pytest.raises(typer.Exit) as ended:
        _run("sft", None, [f"output_dir={out}"], step)
    return ended.value.exit_code, capsys.readouterr().err, read_status(out)


def test_the_table_lists_exactly_the_errors_expected():
    assert set(_classes()) == set(EXPECTED) | {"PhaseError"}
    for name, cls in _classes().items():
        assert isinstance(cls, type) and issubclass(cls, BaseException), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_error_ends_the_run_as_expected(name, tmp_path, capsys):
    cls = _classes()[name]
    if name == "OSError":
        error, text = OSError(errno.ENOSPC, "No space left on device", "/x/f"), \
            "No space left on device '/x/f'; free space or fix the permissions, then run again"
    elif name in ("KeyboardInterrupt", "Terminated"):
        error = cls()
        text = ("SIGINT (Ctrl-C)" if name == "KeyboardInterrupt" else "SIGTERM") + \
            "; checkpoints written so far are intact"
    else:
        error, text = cls(f"boom from {name}"), f"boom from {name}"
    code, err, status = _end_of(error, tmp_path, capsys)
    want_code, want_state, want_label = EXPECTED[name]
    assert code == want_code, err
    assert f"{want_label}: {text}" in " ".join(err.split()), err
    assert "Traceback" not in err
    assert (status["state"], status["message"]) == (want_state, text)


def test_a_non_finite_step_is_recorded_in_the_metrics(tmp_path, capsys):
    from exactrl.distributed.engine import NonFiniteError

    code, _, _ = _end_of(NonFiniteError("gradient norm is nan", step=4), tmp_path, capsys)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records[-1].pop("time")
    assert code == 4 and records[-1] == {"event": "nonfinite", "step": 5, "message": "gradient norm is nan"}


def test_a_phase_ends_the_pipeline_with_its_own_code(tmp_path, capsys):
    from exactrl.pipelines.pipeline import PhaseError

    code, err, status = _end_of(PhaseError("the rl phase stopped", 3), tmp_path, capsys)
    assert code == 3 and "error: the rl phase stopped" in err and status["state"] == "error"


def test_a_bug_keeps_its_traceback_and_is_recorded(tmp_path):
    from exactrl.cli import _run
    from exactrl.run_dir import create_run_dir, read_status

    def step(cfg):
        create_run_dir(cfg.output_dir, "sft", cfg)
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        _run("sft", None, [f"output_dir={tmp_path / 'run'}"], step)
    assert read_status(tmp_path / "run")["state"] == "error"
    assert (exits.BUG.code, exits.BUG.status) == (1, "error")


def test_the_cli_gives_no_exit_code_outside_the_table():
    """cli.py's run path ends only through exits' rows: no literal code passed to _fail (merge and config,
    which run nothing, keep their own 2)."""
    source = (ROOT / "exactrl" / "cli.py").read_text()
    assert not re.findall(r"_fail\([^()]*,\s*\d+\)", source)


def test_the_page_lists_every_code():
    page = exits.render()
    codes = {int(m) for m in re.findall(r"^\| (\d+) \|", page, re.M)}
    assert codes == {0} | {c for c, _, _ in EXPECTED.values()}
    assert "| the phase's |" in page
    for name in EXPECTED:
        assert f"`{name}`" in page, name
