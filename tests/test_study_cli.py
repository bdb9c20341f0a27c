"""A real (tiny) study through the CLI: every cell trained by the trainers, its accuracy the one
`exactrl eval` measures on the same problems, its FLOPs its phases' own counts (an SFT-based cell's
including the SFT phase it continues from), and a second run that re-runs nothing."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from exactrl.cli import app
from exactrl.metrics import read_metrics
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from own_audit import DS, ORLHF, TF, A, N, audited

TASK = {"n_sft": 64, "n_rl": 16, "n_eval": 24}
# the cells are scored with rl.reward.fn: a parity of the text, right on about half of any answers (an
# accuracy that moves with every generated character: the tiny models here answer nothing right)
ARGS = ["methods=[sft,sft_rl,luffy]", "seeds=[0]", "rl.reward.fn=reward_fixtures:parity",
        *(f"task.{k}={v}" for k, v in TASK.items()), "eval_size=24",
        "sft.train.max_steps=4", "sft.train.global_batch_size=16", "sft.train.micro_batch_size=4",
        "base.train.max_steps=3", "base.train.global_batch_size=16", "base.train.micro_batch_size=4",
        "rl.train.max_steps=1", "rl.train.global_batch_size=16", "rl.train.micro_batch_size=8",
        "rl.rollout.max_new_tokens=12", "mixed.train.max_steps=1", "mixed.train.global_batch_size=16",
        "mixed.train.micro_batch_size=8", "mixed.rollout.max_new_tokens=12"]


def last(path, key):
    return max(read_metrics(path), key=lambda r: r["step"])[key]


# one bug grid, both faults on in one SFT cell (the audit below reads it)
BUGS = ["--with-bugs", "bugs.methods=[sft]",
        "bugs.grids={both: [fault.dropped_micro_batches=true, fault.mean_of_means=true, audit.canary=warn]}"]


def test_a_tiny_study_trains_every_cell_and_reports_what_each_measured(tmp_path):
    out = tmp_path / "study"
    run = CliRunner().invoke(app, ["study", *BUGS, *ARGS, f"output_dir={out}"], terminal_width=200)
    assert run.exit_code == 0, run.output
    cells = {m: json.loads((out / "clean" / f"{m}-seed0" / "cell.json").read_text())
             for m in ("sft", "sft_rl", "luffy")}
    # FLOPs: each phase's last logged count; sft_rl adds the SFT phase it continued from
    sft_flops = last(out / "clean" / "sft-seed0" / "metrics.jsonl", "flops")
    assert cells["sft"]["flops"] == sft_flops > 0
    assert cells["sft_rl"]["flops"] == sft_flops + last(out / "clean" / "sft_rl-seed0" / "metrics.jsonl", "flops")
    assert cells["sft_rl"]["seconds"] > cells["sft"]["seconds"]
    # accuracy: what `exactrl eval` measures of the cell's model on the same held-out problems
    eval_file = ensure_builtin(BuiltinSpec(**TASK, model="small")).eval
    for m, cell in cells.items():
        check = CliRunner().invoke(app, ["eval", f"model.path={out / 'clean' / f'{m}-seed0' / 'model'}",
                                         f"data.eval={eval_file}", "eval.reward_fn=reward_fixtures:parity",
                                         "data.eval_size=24", f"output_dir={tmp_path / m}"], terminal_width=200)
        assert check.exit_code == 0, check.output
        measured = json.loads((tmp_path / m / "results.json").read_text())
        assert 0 < sum(cell["outcomes"]) < 24 and cell["accuracy"] == sum(cell["outcomes"]) / 24
        assert (measured["greedy"]["correct"], measured["prompts"]) == (sum(cell["outcomes"]), 24)
        rows = [json.loads(line) for line in (tmp_path / m / "samples.jsonl").read_text().splitlines()]
        assert [int(r["reward"] >= 1) for r in rows] == cell["outcomes"]  # problem by problem, in order
    # every method starts from the base model, pretrained once (its FLOPs in no cell), sft_rl from the SFT cell's
    base = json.loads((out / "base" / "base.json").read_text())
    assert base["flops"] == last(out / "base" / "metrics.jsonl", "flops") > 0 and len(base["outcomes"]) == 24
    starts = {m: json.loads((out / "clean" / f"{m}-seed0" / "manifest.json").read_text())["study_cell"]["start"]
              for m in cells}
    assert starts == {"sft": str(out / "base" / "model"), "luffy": str(out / "base" / "model"),
                      "sft_rl": str(out / "clean" / "sft-seed0" / "model")}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start"]["flops"] == base["flops"] and "pretrained" in (out / "report.md").read_text()
    assert [r["method"] for r in summary["grids"]["clean"]] == ["sft", "sft_rl", "luffy"]
    assert (out / "report.md").exists() and (out / "plot.png").exists()
    # the audit reads each directory that trained as exactrl's run, in the study's config section its cell ran
    # under the cell's overrides (the faults of its grid among them)
    audits = {Path(a.path).relative_to(out).as_posix(): a for a in audited(out)}
    assert {p: [r.value for r in a.facts["trainer"]] for p, a in audits.items()} == {
        "base": ["base"], "bugs-both/sft-seed0": ["sft"], "clean/luffy-seed0": ["rl (luffy)"],
        "clean/sft-seed0": ["sft"], "clean/sft_rl-seed0": ["rl (grpo)"]}
    assert {p: {v.status.value for v in a.verdicts} for p, a in audits.items() if p.startswith("bugs-")} == {
        "bugs-both/sft-seed0": {A, N}}
    assert {v.bug: v.status.value for v in audits["bugs-both/sft-seed0"].verdicts} == {DS: A, ORLHF: A, TF: N}
    assert "The canary (audit.canary=warn) flagged 4 step(s)" in audits["bugs-both/sft-seed0"].verdicts[0].reason
    assert {v.status.value for p, a in audits.items() if not p.startswith("bugs-") for v in a.verdicts} == {N}
    assert {v.status.value for a in audited(tmp_path / "sft") for v in a.verdicts} == {N}  # `exactrl eval`'s
    again = CliRunner().invoke(app, ["study", *BUGS, *ARGS, f"output_dir={out}"], terminal_width=200)
    assert again.exit_code == 0 and "4 already done" in again.output and "[1/4]" not in again.output


def test_cells_run_in_parallel_processes_measure_what_they_measure_one_after_another(tmp_path):
    """jobs=2: each seed's chain of cells in a process of its own. Its cells equal those run in the
    study's own process (same outcomes problem by problem, same FLOPs, weights to float rounding:
    the processes use fewer threads); a cell that fails in a worker is reported by its error and
    the study exits 1, the other cells done."""
    import torch
    from safetensors.torch import load_file

    grid = [*ARGS[2:], "start=init", "methods=[sft,luffy]", "seeds=[0,1]",
            "method_overrides={luffy: [reward.fn=nowhere:fn]}"]
    runs = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        run = CliRunner().invoke(app, ["study", *grid, f"jobs={jobs}", f"output_dir={out}"], terminal_width=200)
        assert run.exit_code == 1, run.output
        assert "2 of 4 cells did not finish" in run.output
        for seed in (0, 1):
            error = (out / "clean" / f"luffy-seed{seed}" / "error.txt").read_text().splitlines()[0]
            assert "nowhere" in error and not (out / "clean" / f"luffy-seed{seed}" / "cell.json").exists()
        runs[jobs] = out
    assert "2 chains of cells (a seed of a grid each), 2 at a time" in run.output
    for seed in (0, 1):
        one, two = (json.loads((runs[j] / "clean" / f"sft-seed{seed}" / "cell.json").read_text()) for j in (1, 2))
        assert one["outcomes"] == two["outcomes"] and one["flops"] == two["flops"] > 0
        w1, w2 = (load_file(runs[j] / "clean" / f"sft-seed{seed}" / "model" / "model.safetensors") for j in (1, 2))
        assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], rtol=0, atol=1e-5) for k in w1)
    seeds = [load_file(runs[2] / "clean" / f"sft-seed{s}" / "model" / "model.safetensors") for s in (0, 1)]
    assert any(not torch.equal(seeds[0][k], seeds[1][k]) for k in seeds[0])  # each seed's cells are its own
