"""train.resume_from=latest: the same command, relaunched after a stop, continues the run in its
own output_dir from its newest complete checkpoint and ends with the weights of an
uninterrupted run; with no checkpoint yet it starts from step 0; it needs a fixed output_dir."""

from __future__ import annotations

import json

import pytest

from exactrl.config import DemoConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.run.context import RunContext
from test_cli_failures import TINY, exactrl, one_line_error
from test_resume import same_weights

RUN = [*TINY, "train.max_steps=4", "train.save_every=2", "optim.warmup_steps=2", "optim.weight_decay=0.01"]


@pytest.fixture(scope="module")
def cache(cli_cache):
    return cli_cache


def stop_after(monkeypatch, last: int):
    """Ctrl-C right after completed step ``last`` (its checkpoint, if any, written)."""
    step_done = RunContext.step_done

    def stopping(self, step, *args):
        step_done(self, step, *args)
        if step == last:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunContext, "step_done", stopping)


def test_relaunching_the_same_command_continues_to_the_uninterrupted_weights(tmp_path, cache, monkeypatch):
    full = tmp_path / "full"
    assert exactrl(["sft", *RUN, f"output_dir={full}"], tmp_path, cache).returncode == 0

    out = tmp_path / "run"
    command = ["sft", *RUN, "train.resume_from=latest", f"output_dir={out}"]
    with monkeypatch.context() as m:
        stop_after(m, 3)  # past checkpoint-2: step 3 is lost and redone
        first = exactrl(command, tmp_path, cache)
    assert first.returncode == 130 and f"no checkpoint in '{out}' yet; starting from step 0" in first.stderr
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]

    again = exactrl(command, tmp_path, cache)
    assert again.returncode == 0, again.stderr
    assert f"continuing '{out}' from checkpoint-2" in again.stderr
    assert same_weights(full / "final", out / "final")
    assert not same_weights(out / "final", out / "checkpoint-2")
    assert json.loads((out / "status.json").read_text())["state"] == "success"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["resume_from"] for r in records if r.get("event") == "continued"] == [str(out / "checkpoint-2")]
    assert len(json.loads((out / "manifest.json").read_text())["previous_attempts"]) == 1

    # Done: a further relaunch has nothing to resume and overwrites nothing.
    done = one_line_error(exactrl(command, tmp_path, cache), 2)
    assert "has written final/" in done and "nothing is left to resume" in done


def test_latest_with_a_time_stamped_output_dir_is_one_line(tmp_path, cache):
    line = one_line_error(exactrl(["sft", *RUN, "train.resume_from=latest", "output_dir=runs/x-{time}"], tmp_path,
                                  cache), 2)
    assert "train.resume_from=latest continues the run in output_dir" in line and "{time}" in line, line
    assert not (tmp_path / "runs").exists()



def test_latest_in_the_demo_is_refused_by_name():
    with pytest.raises(ConfigError, match="sft.train.resume_from=latest: the pipeline continues its phases itself; "
                                          "set resume=true"):
        load_config(DemoConfig, None, ["sft.train.resume_from=latest"])


def test_rl_continues_from_its_latest_checkpoint_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    """The rl loop resolves `latest` the same way (in process, small task: the status an
    interrupted launch leaves is written as exactrl/cli.py's _run writes it)."""
    from exactrl import run_dir
    from exactrl.algorithms.rl import train_rl
    from exactrl.config import RLConfig
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    spec = BuiltinSpec(n_sft=200, n_rl=40, n_eval=10)
    ensure_builtin(spec)  # built before the first run: a train_rl that builds it samples other responses
    common = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
              "train.max_steps=4", "rollout.max_new_tokens=8", "optim.lr=1e-3", "reward.fn=reward_fixtures:varied",
              "train.save_every=2"]
    full = train_rl(load_config(RLConfig, None, [*common, f"output_dir={tmp_path / 'full'}"]), spec=spec)
    run_dir.forget_current()
    out = tmp_path / "run"
    cfg = [*common, "train.resume_from=latest", f"output_dir={out}"]
    with monkeypatch.context() as m:
        stop_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            train_rl(load_config(RLConfig, None, cfg), spec=spec)
    run_dir.set_status("interrupted", "SIGINT")
    run_dir.forget_current()
    again = train_rl(load_config(RLConfig, None, cfg), spec=spec)
    run_dir.forget_current()
    assert again.run_dir == out and same_weights(full.final_model, again.final_model)
    assert not same_weights(again.final_model, out / "checkpoint-2")
