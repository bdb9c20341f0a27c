"""A trained process reward model as `exactrl rl`'s reward (reward.model=DIR of an `exactrl rm rm.kind=process` run,
exactrl/workers/reward_model.py step_reading and ModelReward).

Two tiny PRMs trained here on the built-in steps (a few steps of `exactrl rm`), one with the built-in one-token
separator " ", one with a two-token " ;":

* every response of a rollout (GRPO's collect_rollout on scripted responses: worked solutions, a lone answer with no
  separator, one ending with a separator, cut-off ones, one cut inside the separator) gets reward.model_reduce
  (min, prod, last) of sigmoid of its step scores as the **training-time reader** gives them on the same text:
  the response decoded, split at the separator into a step-labelled row, encoded by data/steps.py encode_steps
  and scored by algorithms/prm.py score_steps (1e-6); reading one token early gives other rewards;
* a one-step GRPO run takes its reward from the PRM (reward/model is the reward, a mean probability);
* refused: reward.model_reduce for a pairwise reward model (exit 2) or without one, and a PRM with
  reward.model_normalize=true (its reward is already a probability);
* the reward server (--model DIR --raw) serves a PRM over text, read the same way.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from exactrl.algorithms.prm import score_steps
from exactrl.algorithms.rm import train_rm
from exactrl.algorithms.sft import resolve
from exactrl.config import RLConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.config.schema_rm import RMConfig
from exactrl.data.encode import Prompt
from exactrl.data.jsonl import Row
from exactrl.data.steps import encode_steps
from exactrl.models.loading import load_value_model
from exactrl.rewards import load_rewards
from exactrl.rewards.server import make_server
from exactrl.rollout.collect import collect_rollout
from exactrl.rollout.generator import Generation
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reward_model import STATS_FILE, RewardModel, model_reward
from exactrl.workers.worker import Worker

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
SEPARATORS = {"space": " ", "two_tokens": " ;"}
WEIGHT = 0.7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(name) -> (the final/ of a 3-step `exactrl rm rm.kind=process` run on the built-in steps with
    SEPARATORS[name], that separator), each trained once."""
    done = {}

    def get(name: str):
        if name not in done:
            sep = SEPARATORS[name]
            extra = [] if sep == " " else [f'rm.step_separator="{sep}"']  # quoted: an override's value is stripped
            cfg = load_config(RMConfig, None, ["rm.kind=process", "model.path=builtin", "data.eval=null",
                                               "train.global_batch_size=8", "train.micro_batch_size=4",
                                               "train.max_steps=3", "optim.lr=1e-3", "rm.stats_pairs=8", *extra,
                                               f"output_dir={tmp_path_factory.mktemp(name)}"])
            final = train_rm(cfg, spec=SPEC).final_model
            assert json.loads((final / STATS_FILE).read_text())["step_separator"] == sep
            done[name] = final, sep
        return done[name]

    return get


@pytest.fixture(params=list(SEPARATORS))
def prm(request, trained):
    return trained(request.param)


@pytest.fixture
def prm_dir(trained):
    """The PRM on the built-in separator, the text the policy writes."""
    return trained("space")[0]


def responses(row: dict, sep: str) -> list[tuple[str, bool]]:
    """Group of four responses (text, ends with EOS) to a built-in step-labelled row's prompt."""
    steps = row["completions"]
    whole = sep.join(steps)
    return [(whole, True),  # the policy's worked solution, its answer step ending at EOS
            (steps[0], True),  # no separator at all (a column step alone): one step
            (whole + sep, True),  # ends with a separator: no empty step after it
            (whole[: len(whole) - 3] + (sep[:1] if len(sep) > 1 else ""), False)]  # cut off (inside the separator)


class ScriptedGenerator:
    def __init__(self, tok, texts: list[list[tuple[str, bool]]]):
        self.tok, self.texts = tok, texts

    def generate(self, prompt_ids, params, seeds=None):
        out = []
        for i, ids in enumerate(prompt_ids):
            for text, finished in self.texts[i]:
                resp = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.eos_token_id] if finished
                                                                                else [])
                out.append(Generation(i, ids, resp, text, finished))
        return out


def rollout(prm_dir, sep: str, tok, reduce: str, tmp_path):
    """GRPO's collect_rollout of six built-in prompts x four scripted responses, the reward the PRM's alone."""
    rows = [json.loads(line) for line in Path(resolve("builtin", "steps_eval", SPEC)).read_text().splitlines()[:6]]
    prompts = [Prompt(tok(r["prompt"])["input_ids"], r["prompt"], r["answer"], f"d:{k}") for k, r in enumerate(rows)]
    cfg = load_config(RLConfig, None, ["train.global_batch_size=24", "train.micro_batch_size=6", "algo.group_size=4",
                                       f"reward.model={prm_dir}", "reward.model_normalize=false",
                                       f"reward.model_reduce={reduce}", "reward.weights=[0]",
                                       f"reward.model_weight={WEIGHT}"])
    fns = load_rewards(cfg.reward.specs(), cfg.reward.weights)
    try:
        fns.model = model_reward(cfg.reward, tok, cfg.train.micro_batch_size)
        fns.model.worker = Worker.build(cfg, "reward", str(prm_dir), run_dir=tmp_path, phase="rl", longest=128,
                                        pad_id=tok.pad_token_id)
        samples, stats = collect_rollout(ScriptedGenerator(tok, [responses(r, sep) for r in rows]), prompts, fns,
                                         cfg, rollout=0)
    finally:
        fns.close()
    return [(r["prompt"], text) for r in rows for text, _ in responses(r, sep)], samples, stats


def training_reader(prm_dir, sep: str, tok, texts: list[tuple[str, str]], early: int = 0) -> list[torch.Tensor]:
    """Each (prompt, response text)'s step logits as `exactrl rm rm.kind=process` reads them: the text split at the
    separator into a step-labelled row (a trailing separator ends the last step), encode_steps, score_steps.
    ``early``: read that many tokens before each step's (to show a wrong position gives other rewards)."""
    rows = []
    for k, (prompt, text) in enumerate(texts):
        steps = text.split(sep)
        if len(steps) > 1 and steps[-1] == "":
            steps.pop()
        rows.append(Row(f"rollout:{k}", {"prompt": prompt, "completions": steps, "labels": [True] * len(steps)}))
    examples = encode_steps(rows, tok, 4096, separator=sep)
    if early:
        examples = [type(e)(e.input_ids, e.prompt_len, [p - early for p in e.positions], e.labels, e.source)
                    for e in examples]
    model = RewardModel("reward", load_value_model(prm_dir).requires_grad_(False), pad_id=tok.pad_token_id)
    return score_steps(model, examples, 4)


REDUCE = {"min": lambda p: p.min(), "prod": lambda p: p.prod(), "last": lambda p: p[-1]}  # written here again


@pytest.mark.parametrize("reduce", list(REDUCE))
def test_each_response_s_reward_is_the_reduction_of_the_training_reader_s_step_scores(prm, tokenizer, reduce,
                                                                                      tmp_path):
    prm_dir, sep = prm
    texts, samples, stats = rollout(prm_dir, sep, tokenizer, reduce, tmp_path)
    assert [s.ids[: len(s.prompt_ids)] for s in samples] == [tokenizer(p)["input_ids"] for p, _ in texts]
    logits = training_reader(prm_dir, sep, tokenizer, texts)
    steps = [len(v) for v in logits]
    assert steps[1::4] == [1] * 6 and min(steps[::4]) >= 4 and steps[2::4] == steps[::4]  # a trailing sep: no step
    expected = [float(REDUCE[reduce](torch.sigmoid(v))) for v in logits]
    assert max(expected) - min(expected) > 1e-2  # the rewards differ: a misread would show
    got = [s.parts["model"] for s in samples]
    assert got == pytest.approx(expected, abs=1e-6)
    assert [s.reward for s in samples] == pytest.approx([WEIGHT * e for e in expected], abs=1e-6)
    assert stats["reward/model"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    # the head one token before each separator's last token (the separator's first, or the step's last) is
    # another reading: its rewards are measurably not the run's
    early = [float(REDUCE[reduce](torch.sigmoid(v))) for v in training_reader(prm_dir, sep, tokenizer, texts, 1)]
    off = max(abs(a - b) for a, b in zip(got, early))
    print(f"separator {sep!r}, {reduce}: max |reward - training reader's| "
          f"{max(abs(a - b) for a, b in zip(got, expected)):.2g}, one token early {off:.3g}")
    assert off > 1e-3


def test_a_grpo_run_takes_its_reward_from_the_process_reward_model(prm_dir, tmp_path, monkeypatch):
    from exactrl.algorithms.rl import train_rl

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["model.path=builtin", "data.eval=null", "train.global_batch_size=8",
                                       "train.micro_batch_size=8", "algo.group_size=4", "train.max_steps=1",
                                       "train.log_every=1", "rollout.max_new_tokens=12", f"reward.model={prm_dir}",
                                       "reward.model_normalize=false", "reward.model_reduce=prod",
                                       "reward.weights=[0]", f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=SPEC)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in rows if "loss" in r]
    assert record["canary"] == 1.0 and 0 < record["reward/model"] < 1  # a mean of probabilities
    assert record["reward_mean"] == pytest.approx(record["reward/model"], abs=1e-9)


def test_model_reduce_is_refused_for_a_pairwise_reward_model_and_without_one(prm_dir, tmp_path):
    from exactrl.cli import app

    pairwise = tmp_path / "pairwise"
    shutil.copytree(prm_dir, pairwise)
    stats = json.loads((pairwise / STATS_FILE).read_text())
    (pairwise / STATS_FILE).write_text(json.dumps({"train": stats["train"]}))  # as a pairwise run saves: no kind
    result = CliRunner().invoke(app, ["rl", f"reward.model={pairwise}", "reward.model_reduce=last",
                                      f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert (f"reward.model_reduce=last has no effect: reward.model={pairwise} is a pairwise reward model"
            in " ".join(result.output.split()))
    load_config(RLConfig, None, [f"reward.model={pairwise}", "reward.model_reduce=min"])  # the default passes
    load_config(RLConfig, None, [f"reward.model={prm_dir}", "reward.model_reduce=last"])
    with pytest.raises(ConfigError, match="reward.model_reduce=prod has no effect: there is no reward model"):
        load_config(RLConfig, None, ["reward.model_reduce=prod"])


def test_a_process_reward_model_is_not_normalised(prm_dir, tokenizer):
    with pytest.raises(ConfigError, match=f"reward.model_normalize=true, but reward.model={prm_dir} is a process "
                                          "reward model"):
        model_reward(load_config(RLConfig, None, [f"reward.model={prm_dir}"]).reward, tokenizer, 4)
    got = model_reward(load_config(RLConfig, None, [f"reward.model={prm_dir}", "reward.model_normalize=false"]).reward,
                       tokenizer, 4)
    assert (got.mean, got.std, got.reduce) == (0.0, 1.0, "min") and got.separator


def test_a_separator_the_tokenizer_cannot_spell_is_refused(prm_dir, tokenizer, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(prm_dir, bad)
    stats = json.loads((prm_dir / STATS_FILE).read_text())
    (bad / STATS_FILE).write_text(json.dumps(stats | {"step_separator": ""}))
    with pytest.raises(ConfigError, match="step_separator is '', not a separator the tokenizer spells"):
        model_reward(load_config(RLConfig, None, [f"reward.model={bad}", "reward.model_normalize=false"]).reward,
                     tokenizer, 4)


def test_the_reward_server_serves_a_process_reward_model_over_text(prm_dir, tokenizer):
    """--model DIR --raw: the text re-tokenised (prompt, completion, EOS), then read as in a run (min)."""
    server = make_server(None, port=0, model=str(prm_dir), normalize=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        texts = [("12+30=", "2+0+0=02 1+3+0=04 #### 42"), ("3+4=", "4+3+0=07"), ("1+1=", "x ")]
        body = json.dumps({"prompts": [p for p, _ in texts], "completions": [c for _, c in texts]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/", body,
                                         {"Content-Type": "application/json"})
        got = json.loads(urllib.request.urlopen(request, timeout=60).read())["rewards"]
    finally:
        server.shutdown()
        server.server_close()
    expected = [float(torch.sigmoid(v).min()) for v in training_reader(prm_dir, " ", tokenizer, texts)]
    assert got == pytest.approx(expected, abs=1e-6)
