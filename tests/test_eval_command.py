"""`exactrl eval`: on a run's saved model it reports the accuracy (and interval) the run's own final
evaluation logged; pass@k is Chen et al.'s unbiased estimator; a missing model, bad data and a bad
reward are one line each, exit 2."""

from __future__ import annotations

import json
import math

import pytest

from exactrl.run.evaluation import pass_at_k
from test_cli_failures import exactrl, one_line_error

# The parity fixture makes the accuracy depend on every generated character (an untrained model's
# checker accuracy is 0 whatever it generates).
EVAL = ["eval.reward_fn=reward_fixtures:parity", "eval.batch_size=16"]
TRAIN = ["train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=2", "data.eval=builtin",
         "data.eval_size=40",
         *EVAL]


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2) / C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c / n
    assert pass_at_k(6, 1, 3) == pytest.approx(1 - 10 / 20)  # C(5,3) / C(6,3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(3, 1, 3) == 1.0  # every sample drawn: the correct one is among them
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


@pytest.fixture(scope="module")
def cache(cli_cache):
    return cli_cache


@pytest.fixture(scope="module", params=["full", "lora"])
def trained(request, tmp_path_factory, cache):
    """A short sft run with its own final evaluation: its final/ (full weights or a LoRA adapter)
    and that evaluation's metrics record, the independent reference."""
    root = tmp_path_factory.mktemp(request.param)
    lora = ["model.lora.rank=4"] if request.param == "lora" else []
    proc = exactrl(["sft", *TRAIN, *lora, f"output_dir={root / 'run'}"], root, cache)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return root, [r for r in records if "eval_accuracy" in r][-1]


def test_eval_reports_what_the_runs_own_final_evaluation_reported(trained, cache, tmp_path):
    root, logged = trained
    proc = exactrl(["eval", f"model.path={root / 'run' / 'final'}", "data.eval_size=40", *EVAL,
                    f"output_dir={tmp_path / 'ev'}"],
                   tmp_path, cache)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert 0 < logged["eval_accuracy"] < 1  # a figure that could differ
    assert results["greedy"]["accuracy"] == logged["eval_accuracy"] and results["greedy"]["ci95"] == logged["eval_ci95"]
    assert (results["pass_at_k"] is None
            and json.loads((tmp_path / "ev" / "status.json").read_text())["state"] == "success")
    low, high = logged["eval_ci95"]
    shown = f"{100 * logged['eval_accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    assert shown in proc.stderr and shown in (tmp_path / "ev" / "report.md").read_text()
    assert len((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()) == 40


def test_pass_at_k_from_the_cli_is_the_estimator_over_the_sample_counts(cache, tmp_path):
    n, ks = 4, [1, 2, 4]
    proc = exactrl(["eval", "model.path=builtin", "data.eval_size=24", "eval.max_new_tokens=12", *EVAL,
                    f"pass_at_k.n={n}",
                    "pass_at_k.k=[1,2,4]", "pass_at_k.temperature=1.5", f"output_dir={tmp_path / 'ev'}"], tmp_path,
                    cache)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "ev" / "results.json").read_text())["pass_at_k"]
    counts = [json.loads(line)["correct_samples"]
              for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    assert len(counts) == 24 and any(0 < c < n for c in counts)  # some prompts where k matters
    for k in ks:  # written out: 1 - C(n-c, k) / C(n, k), averaged over prompts
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)
        assert got["k"][str(k)] == pytest.approx(want, rel=1e-12)
    assert got["k"]["1"] == pytest.approx(sum(counts) / (n * len(counts)), rel=1e-12)
    assert got["k"]["1"] <= got["k"]["2"] <= got["k"]["4"]


def test_eval_refusals_are_one_line(tmp_path, cache):
    line = one_line_error(exactrl(["eval", f"model.path={tmp_path / 'nope'}"], tmp_path, cache), 2)
    assert "nope' is not a directory" in line, line
    line = one_line_error(exactrl(["eval"], tmp_path, cache), 2)
    assert line.startswith("error: model.path: give the model to evaluate"), line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n')
    line = one_line_error(exactrl(["eval", "model.path=builtin", f"data.eval={bad}",
                                   "eval.reward_fn=reward_fixtures:parity"],
                                  tmp_path, cache), 2)
    assert f"{bad}:2" in line and "prompt" in line, line
    line = one_line_error(exactrl(["eval", "model.path=builtin", f"data.eval={bad}"], tmp_path, cache), 2)
    assert "needs eval.reward_fn" in line, line
    line = one_line_error(exactrl(["eval", "model.path=builtin", "eval.reward_fn=reward_fixtures:no_such_fn"], tmp_path,
                                  cache), 2)
    assert "no_such_fn" in line, line
    line = one_line_error(exactrl(["eval", "model.path=builtin", "pass_at_k.k=[1,8]", "pass_at_k.n=4"], tmp_path,
                                  cache), 2)
    assert "pass_at_k.k=[1, 8]: each k must be between 1 and pass_at_k.n=4" in line, line
    line = one_line_error(exactrl(["eval", "model.path=builtin", "pass_at_k.temperature=0.7"], tmp_path, cache), 2)
    assert "pass_at_k.temperature set, but pass_at_k.n=0 draws no samples" in line, line
    assert not list(tmp_path.glob("runs/*"))  # refused before a report directory was made


def test_pass_at_k_samples_written_as_preference_data_that_rm_trains_on(cache, tmp_path):
    """pass_at_k.preference: every sample an unpaired row labelled by the reward (recomputed here), each prompt's
    i-th right sample paired against its i-th wrong one, and the pairs are what `exactrl rm` reads."""
    from reward_fixtures import parity

    n = 4
    proc = exactrl(["eval", "model.path=builtin", "data.eval_size=12", "eval.max_new_tokens=12", *EVAL,
                    f"pass_at_k.n={n}", "pass_at_k.temperature=1.5", "pass_at_k.preference=true",
                    f"output_dir={tmp_path / 'ev'}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr
    ev = tmp_path / "ev"
    unpaired = [json.loads(line) for line in (ev / "unpaired.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (ev / "pairs.jsonl").read_text().splitlines()]
    counts = [json.loads(line)["correct_samples"] for line in (ev / "samples.jsonl").read_text().splitlines()]
    assert len(unpaired) == 12 * n and 0 < len(pairs) < 12 * n // 2
    assert [r["label"] for r in unpaired] == [v == 1.0 for v in parity([r["prompt"] for r in unpaired],
                                                                      [r["completion"] for r in unpaired], None)]
    want = []
    for i, c in enumerate(counts):
        group = unpaired[i * n : (i + 1) * n]
        assert len({r["prompt"] for r in group}) == 1 and sum(r["label"] for r in group) == c
        right = [r["completion"] for r in group if r["label"]]
        wrong = [r["completion"] for r in group if not r["label"]]
        want += [(group[0]["prompt"], a, b) for a, b in zip(right, wrong) if a != b]
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == want
    results = json.loads((ev / "results.json").read_text())
    assert results["preference_pairs"] == len(pairs) and results["preference_unpaired"] == len(unpaired)
    proc = exactrl(["rm", "model.path=builtin", f"data.train={ev / 'pairs.jsonl'}", "data.eval=null",
                    "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=1",
                    f"output_dir={tmp_path / 'rm'}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "rm" / "final" / "reward_stats.json").is_file()
