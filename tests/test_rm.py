"""`exactrl rm`: a Bradley-Terry reward model, exact per pair.

* where it scores: the head's output at the answer's last real token (its EOS), with a tokenizer whose pad
  equals its EOS and a prompt holding an EOS (where a pad-id search reads elsewhere);
* the loss and the update: one SGD step of a float64 value model through the real path (plan_samples with
  unit=2, ScoreTerm, Worker.train_step, the canary) against the paper's one-pass loss written here from the
  head's outputs of each sequence alone, for micro-batches of 1, 2 + 2 + 1 and 5 pairs, margin and centring on;
* a run of `exactrl rm` on the built-in pairs: canary 1, and final/reward_stats.json equal to the saved
  model's scores computed here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from test_preference_data import assistant, data, pad_is_eos_tokenizer, user, write

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from equivalence import SMALL, in_dtype, relative_error
from pair_references import ANSWERS

from distributed_harness import TOL
from exactrl.algorithms.rm import train_rm
from exactrl.algorithms.sft import resolve
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema_rm import RMConfig
from exactrl.data.preference import PairExample, load_pairs
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Objective
from exactrl.losses.pairs import ScoreTerm
from exactrl.losses.preference import PairParams
from exactrl.models.loading import load_tokenizer, load_value_model
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.reward_model import RewardModel

LR, CENTER = 1.0, 0.05
MARGINS = [0.5, -0.25, 1.0, 0.0, 2.0]
SPLITS = {2: [1] * 5, 4: [2, 2, 1], 10: [5]}  # samples per micro-batch -> pairs per micro-batch over 5 pairs


@pytest.fixture(scope="module")
def value_dir(tmp_path_factory, tokenizer):
    """A tiny causal LM on disk: load_value_model gives it a seeded scalar head, as `exactrl rm` does."""
    d = tmp_path_factory.mktemp("lm")
    build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                     seed=3, **SMALL).save_pretrained(str(d))
    return d


def value_model(path):
    model = in_dtype(load_value_model(path, init_seed=7), torch.float64)
    with torch.no_grad():  # a head large enough that the scores differ by O(1): the loss is far from ln 2
        model.score.weight.mul_(30.0)
    return model


def alone(model, s) -> torch.Tensor:
    """The head's output at the last token of ``s``'s sequence, run alone (no padding, no packing)."""
    return model(input_ids=torch.tensor([s.ids])).logits[0, -1, 0]


@pytest.fixture(scope="module")
def pairs(tokenizer):
    ids = [[tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
           for answers in ANSWERS]
    return [s for i, ((c, r), m) in enumerate(zip(ids, MARGINS)) for s in PairExample(
        tokenizer(f"{i}+{i * 7}=")["input_ids"], c, r, f"pairs:{i + 1}", margin=m).samples()]


def test_the_score_is_the_head_at_the_answer_s_last_real_token_with_pad_equal_to_eos(tmp_path):
    tok = pad_is_eos_tokenizer()
    rows = [{"prompt": [user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [assistant("1+1+0=02 #### 02")]},
            {"prompt": [user("12+30=")], "chosen": [assistant("#### 42")], "rejected": [assistant("#### 4")]}]
    samples = [s for e in load_pairs(write(tmp_path, rows), tok, data())[0] for s in e.samples()]
    lm = tmp_path / "lm"
    build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=1, **SMALL).save_pretrained(
        str(lm))
    model = value_model(lm)
    with torch.no_grad():
        expected = torch.stack([alone(model, s) for s in samples])
        width = max(len(s.ids) for s in samples)
        ids = torch.tensor([s.ids + [tok.pad_token_id] * (width - len(s.ids)) for s in samples])
        head = model(input_ids=ids, attention_mask=(torch.arange(width) < torch.tensor(
            [len(s.ids) for s in samples])[:, None]).long()).logits[..., 0]
    # what a pad-id search would read instead: the first pad (= the prompt's end of turn), the last non-pad token
    first_pad = (ids == tok.pad_token_id).long().argmax(-1)
    last_non_pad = (torch.arange(width) * (ids != tok.pad_token_id)).argmax(-1)
    for wrong in (first_pad, last_non_pad):
        assert (head.gather(1, wrong[:, None])[:, 0] - expected).abs().min() > 1e-3
    for packed in (True, False):
        rm = RewardModel("reward_model", model, pad_id=tok.pad_token_id, packed=packed)
        got = rm.score(samples, [[[0, 1, 2], [3]]])  # a micro-batch holding three rows of different lengths
        assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-12)


def reference_loss(model, samples, margin: bool, center: float) -> torch.Tensor:
    """The step's mean over its pairs of -log sigma(r_c - r_r - m) + c (r_c + r_r)^2 (Ouyang et al. 2022, eq. 1;
    Touvron et al. 2023, eq. 2; Eisenstein et al. 2023), r = the head at each sequence's last token, run alone."""
    r = torch.stack([alone(model, s) for s in samples])
    m = torch.tensor([s.margin for s in samples[0::2]], dtype=r.dtype) if margin else 0.0
    chosen, rejected = r[0::2], r[1::2]
    return (-F.logsigmoid(chosen - rejected - m) + center * (chosen + rejected) ** 2).mean()


def sgd_reference(path, samples, margin: bool, center: float) -> tuple[dict, float]:
    model = value_model(path)
    loss = reference_loss(model, samples, margin, center)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, loss.item()


def one_step(path, samples, tok, micro: int, objective: Objective, micro_means: bool = False):
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=10", "train.micro_batch_size=2", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    model = value_model(path)
    worker = RewardModel("reward_model", model, build_engine(model, cfg, total_steps=1), pad_id=tok.pad_token_id)
    plan = plan_samples(samples, micro, "token-mean", unit=2)
    result = worker.train_step(samples, replace(plan, micro_means=micro_means), objective)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result, plan


def bt(margin: bool, center: float) -> Objective:
    return Objective((ScoreTerm(params=PairParams(center_rewards=center), margin=margin),))


@pytest.mark.parametrize("micro", SPLITS)
@pytest.mark.parametrize("margin,center", [(True, CENTER), (False, 0.0)])
def test_the_update_is_the_step_mean_over_pairs_whatever_the_split(value_dir, pairs, tokenizer, micro, margin, center):
    got, result, plan = one_step(value_dir, pairs, tokenizer, micro, bt(margin, center))
    assert [len(mb) // 2 for mb in plan.micro_batches] == SPLITS[micro]
    ref, loss = sgd_reference(value_dir, pairs, margin, center)
    init = value_model(value_dir).state_dict()
    err = relative_error(got, ref, init)
    assert err <= TOL["float64"], err
    assert result.loss == pytest.approx(loss, rel=1e-12) and abs(loss - 0.6931) > 0.05
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-12)
    with torch.no_grad():  # the metrics: means over the step's pairs of the rewards before the step
        r = torch.stack([alone(value_model(value_dir), s) for s in pairs])
    expect = {"chosen_reward": r[0::2].mean(), "rejected_reward": r[1::2].mean(),
              "reward_accuracy": (r[0::2] > r[1::2]).double().mean()}
    assert {k: result.metrics[k] for k in expect} == pytest.approx({k: float(v) for k, v in expect.items()}, rel=1e-10)
    assert 0 < expect["reward_accuracy"] < 1


def test_the_margin_column_is_read_only_when_asked(value_dir, pairs, tokenizer):
    """With rm.margin the update is the margin loss's, not the plain one's (off by far more than rounding); off,
    the column is not read. The peers' per-micro-batch mean over pairs (2 + 2 + 1) is another update."""
    with_margin, _, _ = one_step(value_dir, pairs, tokenizer, 4, bt(True, 0.0))
    without, _, _ = one_step(value_dir, pairs, tokenizer, 4, bt(False, 0.0))
    init = value_model(value_dir).state_dict()
    ref_margin, _ = sgd_reference(value_dir, pairs, True, 0.0)
    ref_plain, _ = sgd_reference(value_dir, pairs, False, 0.0)
    assert relative_error(with_margin, ref_margin, init) <= TOL["float64"]
    assert relative_error(without, ref_plain, init) <= TOL["float64"]
    assert relative_error(with_margin, ref_plain, init) > 1e-3  # 0.05 here: 10^8 x the tolerance
    peers, result, _ = one_step(value_dir, pairs, tokenizer, 4, bt(True, 0.0), micro_means=True)
    err = relative_error(peers, ref_margin, init)
    print(f"per-micro-batch mean over pairs (2+2+1): update off by {err:.3g} relative")
    assert err > 1e-3 and result.stats["canary"] == pytest.approx(1.0)


SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)


def test_rm_on_the_builtin_pairs_saves_the_reward_statistics_of_its_final_scores(tmp_path):
    cfg = load_config(RMConfig, None, ["model.path=builtin", "data.eval=builtin", "train.global_batch_size=8",
                                       "train.micro_batch_size=2", "train.max_steps=3", "train.log_every=1",
                                       "optim.lr=1e-3", "rm.stats_pairs=30", f"output_dir={tmp_path / 'run'}"])
    result = train_rm(cfg, spec=SPEC)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(r["canary"] == 1.0 and r["pairs"] == 8 for r in steps)
    saved = json.loads((result.final_model / "reward_stats.json").read_text())
    model, tok = load_value_model(result.final_model), load_tokenizer(result.final_model)
    with torch.no_grad():
        def scores(kind):
            path = resolve("builtin", kind, SPEC)
            r = torch.stack([alone(model, s) for e in load_pairs(path, tok, cfg.data)[0] for s in e.samples()])
            return r.double()[0::2], r.double()[1::2]

        c, r = (x[:30] for x in scores("pairs_train"))  # the first rm.stats_pairs of its 40 pairs
        e_c, e_r = scores("pairs_eval")
    both = torch.cat([c, r])
    assert saved["train"]["n"] == 60 and saved["train"]["mean"] == pytest.approx(float(both.mean()), abs=1e-6)
    assert saved["train"]["std"] == pytest.approx(float(both.std(correction=0)), rel=1e-5)
    assert saved["train"]["chosen_mean"] == pytest.approx(float(c.mean()), abs=1e-6)
    assert saved["eval"]["n"] == 10 and saved["eval"]["correct"] == int((e_c > e_r).sum())
    assert records[-1]["eval_pairwise_accuracy"] == saved["eval"]["pairwise_accuracy"]
    # each kind of the built-in pairs (direct, working, answer) scored on its own: read from the file's rows
    kinds = [json.loads(line)["rejected_kind"] for line in open(resolve("builtin", "pairs_eval", SPEC))]
    by_kind = saved["eval"]["by_kind"]
    assert set(by_kind) == set(kinds) and sum(v["n"] for v in by_kind.values()) == 10
    for kind, v in by_kind.items():
        idx = [i for i, k in enumerate(kinds) if k == kind]
        assert v["n"] == len(idx) and v["correct"] == int((e_c[idx] > e_r[idx]).sum())
        assert records[-1][f"eval_pairwise_accuracy/{kind}"] == v["pairwise_accuracy"]


def test_rm_margin_on_pairs_without_one_exits_2_naming_the_row(tmp_path):
    from exactrl.cli import app

    p = write(tmp_path, [{"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3"}])
    result = CliRunner().invoke(app, ["rm", f"data.train={p}", "data.eval=null", "rm.margin=true",
                                      "train.global_batch_size=1", "train.micro_batch_size=1",
                                      f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert f"{p}:1 has no 'margin'" in result.output
