"""`exactrl rm` with LoRA (model.lora.rank > 0): adapters on the reward model's body, its scalar head trained whole
(peft's modules_to_save, exactrl/models/lora.py), final/ saved merged as a plain reward model.

* one SGD step of a float64 LoRA reward model through the real path (plan_samples unit=2, ScoreTerm,
  Worker.train_step) equals, for micro-batches of 1, 2 + 2 + 1 and 5 pairs, the step written here in plain torch
  (the mean over the step's pairs of -log sigma(r_c - r_r - m) + c (r_c + r_r)^2, each sequence alone) to 1e-10,
  and moves the adapters and the head only;
* a run's final/ loads as a plain reward model (load_value_model, reward.model=) whose scores are the in-run
  model's, and whose reward_stats.json are its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_rm import CENTER, LR, MARGINS, SPLITS, alone, bt, reference_loss, value_model

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from equivalence import SMALL, in_dtype, relative_error
from pair_references import ANSWERS

from distributed_harness import TOL
from exactrl.algorithms.rm import train_rm
from exactrl.algorithms.sft import resolve
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema import LoraConfig
from exactrl.config.schema_rm import RMConfig
from exactrl.data.preference import PairExample, load_pairs
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.models.loading import load_tokenizer, load_value_model
from exactrl.models.lora import apply_lora, is_adapter_dir, is_peft
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.reward_model import RewardModel, model_reward
from exactrl.workers.worker import Worker

pytest.importorskip("peft")

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
HEAD = {"base_model.model.score.modules_to_save.default.weight", "base_model.model.score.modules_to_save.default.bias"}


@pytest.fixture(scope="module")
def value_dir(tmp_path_factory, tokenizer):
    """test_rm's tiny causal LM on disk: load_value_model gives it a seeded scalar head."""
    d = tmp_path_factory.mktemp("lm")
    build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                     seed=3, **SMALL).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def pairs(tokenizer):
    """test_rm's five pairs of answers of different lengths, each with a margin."""
    ids = [[tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
           for answers in ANSWERS]
    return [s for i, ((c, r), m) in enumerate(zip(ids, MARGINS)) for s in PairExample(
        tokenizer(f"{i}+{i * 7}=")["input_ids"], c, r, f"pairs:{i + 1}", margin=m).samples()]


def lora_value_model(path):
    """The float64 value model of test_rm with rank-4 adapters on every linear layer but the head, A and B drawn
    from one seed (the same model every call; peft starts B at 0, which would leave A's gradient 0)."""
    model = in_dtype(apply_lora(value_model(path), LoraConfig(rank=4, alpha=8.0)), torch.float64)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def trainable_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trainable_is_the_adapters_and_the_whole_head(value_dir):
    model = lora_value_model(value_dir)
    names = trainable_state(model)
    assert {n for n in names if "lora_" not in n} == HEAD
    assert any("lora_A" in n for n in names) and not any("score" in n and "lora_" in n for n in names)


@pytest.mark.parametrize("micro", SPLITS)
def test_one_lora_step_is_the_plain_torch_step_whatever_the_split(value_dir, pairs, tokenizer, micro):
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=10", "train.micro_batch_size=2", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    model = lora_value_model(value_dir)
    init, frozen = trainable_state(model), {n: p.detach().clone() for n, p in model.named_parameters()
                                            if not p.requires_grad}
    worker = RewardModel("reward_model", model, build_engine(model, cfg, total_steps=1), pad_id=tokenizer.pad_token_id)
    plan = plan_samples(pairs, micro, "token-mean", unit=2)
    assert [len(mb) // 2 for mb in plan.micro_batches] == SPLITS[micro]
    result = worker.train_step(pairs, plan, bt(True, CENTER))

    ref_model = lora_value_model(value_dir)  # the reference: the loss from its formula, one backward, p -= lr g
    loss = reference_loss(ref_model, pairs, True, CENTER)
    loss.backward()
    ref = {n: p.detach() - LR * p.grad for n, p in ref_model.named_parameters() if p.requires_grad}
    got = trainable_state(model)
    err = relative_error(got, ref, init)
    assert err <= TOL["float64"], err
    assert all(float((got[n] - init[n]).abs().max()) > 0 for n in got)  # every adapter tensor and the head moved
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert result.loss == pytest.approx(loss.item(), rel=1e-12) and abs(loss.item() - 0.6931) > 0.05
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-12)


def test_a_lora_run_saves_a_plain_reward_model_that_scores_as_the_run_did(tmp_path, monkeypatch):
    built = {}
    build = Worker.build.__func__

    def keep(cls, cfg, role, path, **kw):
        built[role] = build(cls, cfg, role, path, **kw)
        return built[role]

    monkeypatch.setattr(Worker, "build", classmethod(keep))
    cfg = load_config(RMConfig, None, ["model.path=builtin", "data.eval=builtin", "train.global_batch_size=8",
                                       "train.micro_batch_size=2", "train.max_steps=3", "train.log_every=1",
                                       "optim.lr=1e-2", "rm.stats_pairs=30", "model.lora.rank=4",
                                       f"output_dir={tmp_path / 'run'}"])
    result = train_rm(cfg, spec=SPEC)
    final = result.final_model
    assert (final / "config.json").is_file() and not is_adapter_dir(final) and not (final / "merged").exists()
    in_run = built["reward_model"].model
    assert is_peft(in_run) and {n for n in trainable_state(in_run) if "lora_" not in n} == HEAD  # trained with LoRA
    base = load_value_model(resolve("builtin", "model", SPEC), init_seed=cfg.train.seed)
    saved, tok = load_value_model(final), load_tokenizer(final)
    assert saved.state_dict().keys() == base.state_dict().keys()  # a plain reward model: no adapter in it
    heldout = [s for e in load_pairs(resolve("builtin", "pairs_eval", SPEC), tok, cfg.data)[0] for s in e.samples()]
    with torch.no_grad():
        want = torch.stack([alone(in_run, s) for s in heldout])
        got = torch.stack([alone(saved, s) for s in heldout])
        before = torch.stack([alone(base, s) for s in heldout])
    print(f"merged vs in-run scores: max |diff| {float((got - want).abs().max()):.3g}, the run moved them by "
          f"{float((want - before).abs().max()):.3g}")
    assert float((got - want).abs().max()) <= 1e-5 * (1 + float(want.abs().max()))  # fp32 merge rounding
    assert float((want - before).abs().max()) > 1e-3  # the run moved the scores (the merged body and head carry it)
    stats = json.loads((final / "reward_stats.json").read_text())
    assert stats["eval"]["correct"] == int((got[0::2] > got[1::2]).sum())
    reward = model_reward(SimpleNamespace(model=str(final), model_weight=1.0, model_normalize=True), tok, 2)
    assert (reward.mean, reward.std) == (stats["train"]["mean"], stats["train"]["std"])  # reward.model= reads it


def test_rm_merge_on_save_with_lora_exits_2(tmp_path):
    from typer.testing import CliRunner

    from exactrl.cli import app

    result = CliRunner().invoke(app, ["rm", "model.lora.rank=4", "model.lora.merge_on_save=true",
                                      f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "exactrl rm always saves its final reward model with the adapters merged in" in " ".join(
        result.output.split())


def test_a_lora_run_resumed_from_its_checkpoint_ends_at_the_uninterrupted_run_s_model(tmp_path):
    """A checkpoint holds the adapters and the trained head (peft's modules_to_save), not the frozen body: resumed
    at step 1 of 3, final/ is the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    common = ["model.path=builtin", "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2",
              "train.max_steps=3", "train.save_every=1", "optim.lr=1e-2", "model.lora.rank=4", "rm.stats_pairs=8"]
    whole = train_rm(load_config(RMConfig, None, [*common, f"output_dir={tmp_path / 'a'}"]), spec=SPEC)
    checkpoint = whole.run_dir / "checkpoint-1"
    assert is_adapter_dir(checkpoint)
    resumed = train_rm(load_config(RMConfig, None, [*common, f"output_dir={tmp_path / 'b'}",
                                                    f"train.resume_from={checkpoint}"]), spec=SPEC)
    a, b = (load_file(str(r.final_model / "model.safetensors")) for r in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
