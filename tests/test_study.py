"""`exactrl study`: the grid's order and resumption, a failed cell that does not stop the others,
the intervals over seeds and problems, the tables and what the bugs did. The cells' training is
replaced by a scripted one here (tests/test_study_cli.py runs a real grid through the CLI)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from exactrl.config import ConfigError, load_config
from exactrl.config.schema_study import StudyConfig
from exactrl.pipelines import study as study_module
from exactrl.pipelines.study import Cell, Study, StudyIncomplete, grid
from exactrl.pipelines.study_report import grid_rows, interval
from exactrl.run_dir import set_status

# the scripted studies run in this process (their training is a monkeypatched one) from the initial model
SCRIPTED = ["jobs=1", "start=init"]


def finished(study: Study, state: str = "success") -> dict:
    """Run ``study`` and end its status as the CLI does."""
    try:
        summary = study.run()
    except StudyIncomplete:
        set_status("error")
        raise
    set_status(state)
    return summary


def test_the_grid_runs_sft_first_then_the_rest_per_seed_and_bug_grids_only_their_methods():
    cfg = load_config(StudyConfig, None, [*SCRIPTED, "methods=[grpo,sft_rl,sft]", "seeds=[3,4]"])
    assert [(c.method, c.seed) for c in grid(cfg)] == [("sft", 3), ("grpo", 3), ("sft_rl", 3), ("sft", 4),
                                                        ("grpo", 4), ("sft_rl", 4)]
    bugs = grid(cfg, "dropped-micro-batches")
    assert {c.grid for c in bugs} == {"dropped-micro-batches"}
    assert [(c.method, c.seed) for c in bugs] == [("sft", 3), ("sft_rl", 3), ("sft", 4), ("sft_rl", 4)]
    only_rl = load_config(StudyConfig, None, ["seeds=[0]", "methods=[grpo]"])
    assert grid(only_rl) == [Cell("grpo", 0)]  # no SFT phase to run


def test_a_method_that_does_not_exist_is_refused_by_name():
    with pytest.raises(ConfigError, match="methods: nope is not a method"):
        load_config(StudyConfig, None, ["methods=[sft,nope]"])
    with pytest.raises(ConfigError, match="method_overrides: nope is not a method"):
        load_config(StudyConfig, None, ["method_overrides={nope: [optim.lr=1]}"])


def test_the_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    """The bootstrap over seeds and problems, checked by simulation: each study draws 100 problems
    of random difficulty and 3 seeds that shift every problem a little; the true accuracy is that
    of the whole population of problems and seeds (about 0.58). Over 200 studies the interval holds
    it in 91-99% of them; and a paired difference of a method with itself is exactly 0."""
    rng = np.random.default_rng(1)
    population = rng.normal(0.0, 1.0, size=(400, 1)) + rng.normal(0.0, 0.1, size=(1, 2500))
    truth = (1 / (1 + np.exp(-(0.405 + population)))).mean()
    hits, n = 0, 200
    for _ in range(n):
        logits = 0.405 + rng.normal(0.0, 1.0, size=(1, 100)) + rng.normal(0.0, 0.1, size=(3, 1))
        outcomes = (rng.random((3, 100)) < 1 / (1 + np.exp(-logits))).astype(int)
        _, low, high = interval({s: list(row) for s, row in enumerate(outcomes)})
        hits += low <= truth <= high
    assert 0.91 <= hits / n <= 0.99, hits / n
    same = {0: [1, 0, 1, 1], 1: [0, 0, 1, 1]}
    assert interval(same, same) == (0.0, 0.0, 0.0)
    est, low, high = interval({0: [1] * 50 + [0] * 50}, {0: [0] * 100})
    assert est == pytest.approx(0.5) and low < 0.5 < high


@pytest.fixture
def scripted(monkeypatch):
    """Cells whose 'training' returns scripted accuracies per (grid, method, seed) and counts calls."""
    calls = []
    accuracy = {"sft": 0.4, "sft_rl": 0.6, "grpo": 0.1}
    fault_cost = {"dropped-micro-batches": 0.2, "mean-of-means": 0.05}

    def train(self, cell, where):
        calls.append((cell.grid, cell.method, cell.seed))
        if cell.method == "grpo" and cell.seed == 1 and self.cfg.output_dir.endswith("fail"):
            raise RuntimeError("the reward server went away")
        p = accuracy[cell.method] - fault_cost.get(cell.grid, 0.0)
        (where / "model").mkdir()
        (where / "model" / "p").write_text(str(p))
        return {"phases": {}, "flops": {"sft": 1e12, "sft_rl": 1.5e12, "grpo": 5e11}[cell.method], "seconds": 1.0,
                "canary_flagged": 7 if cell.grid == "dropped-micro-batches" else 0, "faults": []}

    def evaluate(self, model_dir):
        p = float((model_dir / "p").read_text())
        k = round(p * 100)
        return {"accuracy": k / 100, "outcomes": [1] * k + [0] * (100 - k)}

    monkeypatch.setattr(Study, "train", train)
    monkeypatch.setattr(Study, "evaluate", evaluate)
    monkeypatch.setattr(study_module, "ensure_builtin", lambda spec: type("P", (), {
        "sft_train": None, "mixed_train": None, "eval": None, "model": None})())
    return calls


def test_a_failed_cell_is_reported_the_rest_go_on_and_a_rerun_only_does_what_is_missing(tmp_path, scripted):
    out = tmp_path / "study-fail"
    cfg = load_config(StudyConfig, None, [*SCRIPTED, "methods=[sft,sft_rl,grpo]", "seeds=[0,1]", f"output_dir={out}"])
    console = Console(record=True, width=200)
    with pytest.raises(StudyIncomplete, match="1 of 6 cells did not finish"):
        finished(Study(cfg, console))
    summary = json.loads((out / "summary.json").read_text())
    assert len(scripted) == 6 and summary["failed"] == {"clean/grpo-seed1": "RuntimeError: the reward server went away"}
    text = console.export_text()
    assert "cell clean/grpo-seed1 failed: RuntimeError: the reward server went away (the others go on" in text
    assert "1 cell(s) did not finish: clean/grpo-seed1" in text
    assert "reward server" in (out / "clean" / "grpo-seed1" / "error.txt").read_text()
    assert json.loads((out / "clean" / "sft_rl-seed0" / "cell.json").read_text())["accuracy"] == 0.6
    scripted.clear()
    with pytest.raises(StudyIncomplete):  # the same directory: only the failed cell again (and again it fails)
        finished(Study(cfg, Console(file=open("/dev/null", "w"))))
    assert scripted == [("clean", "grpo", 1)]
    scripted.clear()
    more = load_config(StudyConfig, None, [*SCRIPTED, "methods=[sft,sft_rl,grpo]", "seeds=[0,1,2]",
                                           f"output_dir={out}"])
    with pytest.raises(StudyIncomplete):  # a new seed's cells join; the failing cell is tried again
        finished(Study(more, Console(file=open("/dev/null", "w"))))
    assert scripted == [("clean", "grpo", 1), ("clean", "sft", 2), ("clean", "sft_rl", 2), ("clean", "grpo", 2)]
    ok = load_config(StudyConfig, None, [*SCRIPTED, "methods=[sft,sft_rl]", "seeds=[0,1,2]", f"output_dir={out}"])
    scripted.clear()
    finished(Study(ok, Console(file=open("/dev/null", "w"))))  # a subset: every cell done, nothing runs
    assert scripted == []
    new_seed = load_config(StudyConfig, None, [*SCRIPTED, "methods=[sft,sft_rl]", "seeds=[3]", f"output_dir={out}"])
    finished(Study(new_seed, Console(file=open("/dev/null", "w"))))  # a finished study takes a new seed
    assert scripted == [("clean", "sft", 3), ("clean", "sft_rl", 3)]


def test_with_bugs_runs_the_faulty_methods_again_and_reports_how_far_each_bug_moved_them(tmp_path, scripted):
    cfg = load_config(StudyConfig, None, [*SCRIPTED, "seeds=[0]", "methods=[sft,sft_rl,grpo]",
                                          f"output_dir={tmp_path / 's'}"])
    console = Console(record=True, width=250)
    summary = finished(Study(cfg, console, with_bugs=True))
    assert sorted(scripted) == sorted([("clean", "sft", 0), ("clean", "sft_rl", 0), ("clean", "grpo", 0),
                                       ("dropped-micro-batches", "sft", 0), ("dropped-micro-batches", "sft_rl", 0),
                                       ("mean-of-means", "sft", 0), ("mean-of-means", "sft_rl", 0)])
    rows = {g: {r["method"]: r for r in summary["grids"][g]} for g in ("clean", "dropped-micro-batches")}
    assert rows["clean"]["sft_rl"]["accuracy"][0] == pytest.approx(0.6)
    assert rows["dropped-micro-batches"]["sft_rl"]["accuracy"][0] == pytest.approx(0.4)
    # not run with faults: its clean cell
    assert rows["dropped-micro-batches"]["grpo"]["accuracy"][0] == pytest.approx(0.1)
    assert rows["dropped-micro-batches"]["sft_rl"]["faulty"] and not rows["dropped-micro-batches"]["grpo"]["faulty"]
    assert (rows["clean"]["sft_rl"]["rank"], rows["dropped-micro-batches"]["sft_rl"]["rank"]) == (1, 1)
    text = console.export_text()
    assert "dropped-micro-batches moved sft_rl by -20.0 [" in text and "the canary flagged 7 steps" in text
    assert "mean-of-means moved sft by -5.0 [" in text
    report = (tmp_path / "s" / "report.md").read_text()
    assert "## What the bugs did" in report and "The bugs, side by side" in report


def test_the_rows_rank_ties_together_and_take_differences_against_sft_then_rl(tmp_path, scripted):
    cfg = load_config(StudyConfig, None, [*SCRIPTED, "seeds=[0]", "methods=[sft,sft_rl,grpo]",
                                          f"output_dir={tmp_path / 's'}"])
    study = Study(cfg, Console(file=open("/dev/null", "w")))
    finished(study)
    results = {c: study.result(c) for c in grid(cfg)}
    rows = {r["method"]: r for r in grid_rows(cfg, "clean", results)}
    assert [rows[m]["rank"] for m in ("sft_rl", "sft", "grpo")] == [1, 2, 3]
    assert rows["sft"]["vs_reference"][0] == pytest.approx(-0.2) and rows["sft_rl"]["vs_reference"][0] != 0


def test_config_check_plans_a_study_per_method(tmp_path):
    """`exactrl config check` knows a study config by its sections and plans one seed's phases: the
    shared SFT phase, then each method's RL phase (the truncated one with its own steps)."""
    from typer.testing import CliRunner

    from exactrl.cli import app

    path = tmp_path / "study.yaml"
    path.write_text("methods: [sft, sft_rl, sft_rl_truncated, grpo]\nseeds: [0, 1]\ntruncated: {max_steps: 3}\n"
                    "task: {n_sft: 64, n_rl: 16, n_eval: 8}\n")
    out = CliRunner().invoke(app, ["config", "check", str(path), "--params", "1e6", "--tokens-per-sample", "50"],
                             terminal_width=200)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].endswith("a valid `exactrl study` config")
    heads = [line for line in lines if not line.startswith(" ")][1:]
    assert heads[:5] == ["base: 800 optimizer steps of 32 samples", "sft: 400 optimizer steps of 32 samples",
                         "sft_rl: rl: 40 optimizer steps of 128 samples (40 rollouts of 16 prompts x 8 responses)",
                         "sft_rl_truncated: rl: 3 optimizer steps of 128 samples (3 rollouts of 16 prompts x 8 "
                         "responses)",
                         "grpo: rl: 400 optimizer steps of 128 samples (400 rollouts of 32 prompts x 4 responses)"]
    assert "x 2 for the whole study" in out.output
