"""A process reward model (`exactrl rm rm.kind=process`): per-step binary cross-entropy at the step separators,
normalised over every labelled step of the optimizer step.

* where it scores: the head at each separator's last token (a two-token separator), packed and padded, against the
  row run alone;
* the loss and the update: one SGD step of a float64 value model through the real path (StepExample.sample,
  plan_samples, ProcessTerm, Worker.train_step, the canary) against the formula written out in
  tests/dist/prm_references.py, for micro-batches of 1, 2 and 6 rows (holding 1 to 14 steps), packed and padded;
  the peers' per-micro-batch mean over steps is another update (and is their formula);
* the command: bad rows exit 2 naming file:line; a run on the built-in steps with canary 1 whose reward_stats.json
  and held-out accuracies equal the saved model's step logits computed here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from equivalence import relative_error
from prm_references import make_steps, reference_loss, sgd_reference, step_logits, value_model

from distributed_harness import TOL, layout_params, layout_results, over_bound
from exactrl.algorithms.prm import first_wrong
from exactrl.algorithms.rm import train_rm
from exactrl.algorithms.sft import resolve
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema_rm import RMConfig
from exactrl.data.steps import load_steps
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Objective
from exactrl.losses.process import ProcessTerm
from exactrl.models.loading import load_tokenizer, load_value_model
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reward_model import RewardModel

LR = 1.0
PRM = Objective((ProcessTerm(),))
SPLITS = {1: [1, 5, 2, 6, 1, 3], 2: [6, 8, 4], 6: [18]}  # rows per micro-batch -> steps per micro-batch
SCRIPT = Path(__file__).parent / "dist" / "prm_equivalence.py"


@pytest.fixture(scope="module")
def rows(tokenizer):
    return make_steps(tokenizer)


@pytest.mark.parametrize("packed", [True, False])
def test_the_step_score_is_the_head_at_the_separator_s_last_token(rows, tokenizer, packed):
    model = value_model(tokenizer)
    rm = RewardModel("reward_model", model, pad_id=tokenizer.pad_token_id, packed=packed)
    samples = [e.sample() for e in rows]
    got = rm.forward(samples, "scores", [[[0, 1, 2], [3, 4, 5]]])  # rows of different lengths side by side
    with torch.no_grad():
        for e, v in zip(rows, got):
            alone = model(input_ids=torch.tensor([e.input_ids])).logits[0, :, 0]
            assert v[e.targets].tolist() == pytest.approx(alone[e.positions].tolist(), abs=1e-12)
            # one token early is the separator's first token: a different score
            assert (v[[t - 1 for t in e.targets]] - alone[e.positions]).abs().min() > 1e-3
    for e, s in zip(rows, samples):  # the loss targets are exactly the steps, each carrying its label
        assert [t for t, m in enumerate(s.loss_mask) if m] == e.targets and s.loss_tokens == len(e.labels)
        assert s.step_labels[e.targets].tolist() == [float(y) for y in e.labels] and s.step_labels.sum() == sum(
            e.labels)


@pytest.fixture(scope="module")
def reference(rows, tokenizer):
    """The one-pass reference's update, and its loss, step logits and labels before the step."""
    ref, init = sgd_reference(tokenizer, rows, LR, 1)
    with torch.no_grad():
        model = value_model(tokenizer)
        loss = float(reference_loss(model, rows))
        logits = torch.cat([step_logits(model, e) for e in rows])
    return ref, init, loss, logits, torch.tensor([y for e in rows for y in e.labels])


def one_step(rows, tok, micro: int, packed: bool = True, micro_means: bool = False):
    """(parameters after one SGD step, the step's result, its plan) through Worker.train_step."""
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=6", "train.micro_batch_size=1", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    model = value_model(tok)
    worker = RewardModel("reward_model", model, build_engine(model, cfg, total_steps=1), pad_id=tok.pad_token_id,
                         packed=packed)
    samples = [e.sample() for e in rows]
    plan = plan_samples(samples, micro, "token-mean")
    result = worker.train_step(samples, replace(plan, micro_means=micro_means), PRM)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result, plan


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("micro", SPLITS)
def test_the_update_is_the_mean_over_every_labelled_step_whatever_the_split(rows, tokenizer, reference, micro,
                                                                           packed):
    got, result, plan = one_step(rows, tokenizer, micro, packed)
    assert [sum(len(rows[i].labels) for i in mb) for mb in plan.micro_batches] == SPLITS[micro]
    ref, init, loss, logits, labels = reference
    err = relative_error(got, ref, init)
    assert err <= TOL["float64"], err
    accuracy = float(((logits > 0) == labels).double().mean())
    assert result.loss == pytest.approx(loss, rel=1e-12) and abs(loss - 0.6931) > 0.05
    assert result.metrics["step_accuracy"] == pytest.approx(accuracy, abs=1e-12) and 0 < accuracy < 1
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-12)


def test_the_peers_mean_over_each_micro_batch_s_steps_is_another_update(rows, tokenizer, reference):
    """TRL's PRMTrainer and OpenRLHF's PRMLoss average over each micro-batch's steps, then divide by the accumulation
    steps (fault.mean_of_means reproduces it, StepPlan.micro_means): on micro-batches of 6, 8 and 4 steps that is
    measurably not the step's update, it is the peers' formula, and the canary cannot see it."""
    got, result, plan = one_step(rows, tokenizer, 2, micro_means=True)
    ref, init = reference[:2]
    err = relative_error(got, ref, init)
    print(f"per-micro-batch mean over steps (6+8+4 steps): update off by {err:.3g} relative")
    assert err > 1e-3, err
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-12)
    peers, _ = sgd_reference(tokenizer, rows, LR, 1, groups=[list(mb) for mb in plan.micro_batches])
    assert relative_error(got, peers, init) <= TOL["float64"]


def test_a_bad_step_row_exits_2_naming_its_line(tmp_path):
    from exactrl.cli import app

    good = {"prompt": "1+1=", "completions": ["1+1+0=02", "#### 2"], "labels": [True, True]}
    bad = {"prompt": "2+2=", "completions": ["2+2+0=04", "#### 4"], "labels": [True]}
    p = tmp_path / "steps.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    result = CliRunner().invoke(app, ["rm", "rm.kind=process", f"data.train={p}", "data.eval=null",
                                      "train.global_batch_size=1", "train.micro_batch_size=1",
                                      f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert f"{p}:2: 'labels' has 1 entries for 2 steps" in " ".join(result.output.split())


def test_a_pair_s_settings_are_refused_for_a_process_reward_model(tmp_path):
    from exactrl.config.loader import ConfigError

    with pytest.raises(ConfigError, match="rm.margin=true has no effect: rm.kind=process scores steps"):
        load_config(RMConfig, None, ["rm.kind=process", "rm.margin=true"])
    with pytest.raises(ConfigError, match="rm.step_separator=; has no effect: rm.kind=pairwise"):
        load_config(RMConfig, None, ["rm.step_separator=;"])


SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)


def test_prm_on_the_builtin_steps_saves_its_statistics_and_held_out_accuracies(tmp_path):
    cfg = load_config(RMConfig, None, ["rm.kind=process", "model.path=builtin", "train.global_batch_size=8",
                                       "train.micro_batch_size=4", "train.max_steps=3", "train.log_every=1",
                                       "optim.lr=1e-3", "rm.stats_pairs=30", f"output_dir={tmp_path / 'run'}"])
    result = train_rm(cfg, spec=SPEC)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(r["canary"] == 1.0 and r["rows"] == 8 for r in steps)
    saved = json.loads((result.final_model / "reward_stats.json").read_text())
    assert saved["kind"] == "process" and saved["step_separator"] == " "
    model, tok = load_value_model(result.final_model), load_tokenizer(result.final_model)
    with torch.no_grad():
        def logits(kind):
            examples = load_steps(resolve("builtin", kind, SPEC), tok, cfg.data, " ")[0]
            return [step_logits(model, e).double() for e in examples], [e.labels for e in examples]

        train, train_labels = logits("steps_train")
        held, held_labels = logits("steps_eval")
    every = torch.cat(train[:30])  # the first rm.stats_pairs of its 40 rows
    assert saved["train"]["n"] == every.numel() and saved["train"]["mean"] == pytest.approx(float(every.mean()),
                                                                                            abs=1e-6)
    assert saved["train"]["std"] == pytest.approx(float(every.std(correction=0)), rel=1e-5)
    correct = torch.cat([s[torch.tensor(y)] for s, y in zip(train[:30], train_labels[:30])])
    assert saved["train"]["correct_mean"] == pytest.approx(float(correct.mean()), abs=1e-6)
    k = sum(int(((s > 0) == torch.tensor(y)).sum()) for s, y in zip(held, held_labels))
    first = sum(first_wrong((s > 0).tolist()) == first_wrong(y) for s, y in zip(held, held_labels))
    e = saved["eval"]
    assert (e["n"], e["correct"], e["rows"], e["first_wrong_correct"]) == (sum(map(len, held_labels)), k, 10, first)
    assert records[-1]["eval_step_accuracy"] == e["step_accuracy"]


# FSDP2 at world size 2 (uneven ranks: 4 and 14 steps) in CI; world size 1 and DeepSpeed under `slow`
@pytest.fixture(scope="module", params=layout_params(slow=("fsdp2-world1", "deepspeed-world1", "deepspeed-world2")))
def layouts(request, tmp_path_factory):
    return layout_results(request, tmp_path_factory, SCRIPT, "prm")


def test_every_backend_applies_the_mean_over_the_step_s_labelled_steps(layouts):
    backend, world, r = layouts
    if world == 2:
        assert {tuple(c["steps_per_rank"]) for c in r["cases"]} >= {(4, 14)}
    bad = over_bound(r["cases"])
    assert not bad, bad
    assert all(abs(c["canary"] - 1) < 1e-9 for c in r["cases"]), r["cases"]
    peers = r["peers"]
    assert peers["rel_err"] > 1e-3 and abs(peers["canary"] - 1) < 1e-9, peers
    assert peers["peers_formula_err"] <= TOL[peers["precision"]], peers  # and it is the peers' formula
    print(f"{backend} world {world}: {len(r['cases'])} cases, max relative error "
          f"{max(c['rel_err'] for c in r['cases']):.2g}; the peers' per-micro-batch mean {peers['rel_err']:.3g}")
