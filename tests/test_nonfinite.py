"""Non-finite losses and gradients: a step holding inf or NaN is never applied (train.nonfinite
= error stops, skip leaves the weights and optimizer state untouched), and weights that are not
finite are never saved."""

from __future__ import annotations

import pytest
import torch

from exactrl.algorithms.sft import train_sft
from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.checkpoint import save_pretrained
from exactrl.distributed.engine import NonFiniteError, build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.tasks.builtin import BuiltinSpec
from rl_helpers import sft_micro_batch_loss

SPEC = BuiltinSpec(n_sft=64, n_rl=16, n_eval=8)
CFG = ["optim.lr=1e-2", "optim.scheduler=constant", "train.global_batch_size=4", "train.micro_batch_size=2"]


def examples(tokenizer):
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": f"#### {2 * i}"}) for i in range(4)]
    return encode_sft(rows, tokenizer, 64)


def run_step(engine, model, tokenizer, exs, poison: float | None = None):
    plan = plan_step([e.loss_tokens for e in exs], 2, "token-mean")
    engine.begin_step(len(plan.micro_batches))
    for i, mb in enumerate(plan.micro_batches):
        loss, share = sft_micro_batch_loss(model, engine, [exs[j] for j in mb], tokenizer.pad_token_id, plan.normalizer)
        engine.backward(loss * poison if poison is not None and i == 1 else loss, share, len(mb))
    return engine.step(plan)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_error_policy_stops_before_the_step(tokenizer, make_model, poison):
    model = make_model(1)
    engine = build_engine(model, load_config(SFTConfig, None, CFG), total_steps=4)
    before = params(model)
    with pytest.raises(NonFiniteError,
                       match=r"optimizer step 1: the gradient norm is (nan|inf), so the step was not applied"):
        run_step(engine, model, tokenizer, examples(tokenizer), poison)
    assert all(a.equal(b) for a, b in zip(params(model), before))


# A skipped step moves the schedule without an optimizer step: torch's warning about that order is expected and hidden.
@pytest.mark.filterwarnings("error::UserWarning")
def test_skip_policy_applies_nothing_then_steps_as_if_the_bad_step_never_came(tokenizer, make_model):
    exs = examples(tokenizer)
    ref = make_model(2)  # reference: only the good step, on a fresh AdamW
    run_step(build_engine(ref, load_config(SFTConfig, None, CFG), total_steps=4), ref, tokenizer, exs)

    model = make_model(2)
    engine = build_engine(model, load_config(SFTConfig, None, [*CFG, "train.nonfinite=skip"]), total_steps=4)
    before = params(model)
    stats = run_step(engine, model, tokenizer, exs, float("nan"))
    assert stats["skipped_nonfinite"] == 1 and all(a.equal(b) for a, b in zip(params(model), before))
    assert not engine.optimizer.state  # AdamW's moments were not fed the NaN
    stats = run_step(engine, model, tokenizer, exs)
    assert stats["skipped_nonfinite"] == 1  # a running total
    assert all(a.equal(b) for a, b in zip(params(model), params(ref)))


def test_skip_is_refused_on_deepspeed():
    from exactrl.config.loader import ConfigError

    with pytest.raises(ConfigError, match="train.nonfinite=skip needs distributed.backend single or fsdp2"):
        load_config(SFTConfig, None, ["train.nonfinite=skip", "distributed.backend=deepspeed"])


def test_weights_that_are_not_finite_are_never_saved(tmp_path, tokenizer, make_model):
    model = make_model(3)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="the weights hold inf or NaN"):
        save_pretrained(tmp_path / "final", model, tokenizer)
    assert not any(tmp_path.iterdir())  # not even a temporary directory


def test_a_diverging_run_stops_and_saves_no_model(tmp_path, monkeypatch):
    """optim.lr=1e38: AdamW's first step moves every weight by about lr, which overflows fp32
    (measured: every parameter inf); step 2's gradient is NaN."""
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(SFTConfig, None, ["data.eval=null", "train.max_steps=3", "train.global_batch_size=8",
                                        "train.micro_batch_size=4", "optim.lr=1e38", "train.max_grad_norm=0",
                                        f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(NonFiniteError, match="optimizer step 2: the gradient norm is nan"):
        train_sft(cfg, spec=SPEC)
    assert not (tmp_path / "run" / "final").exists()
    # With skip, every later step is skipped, and the final save still refuses the inf weights.
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"nonfinite": "skip"}),
                                 "output_dir": str(tmp_path / "run2")})
    with pytest.raises(NonFiniteError, match="the weights hold inf or NaN"):
        train_sft(cfg, spec=SPEC)
    assert not (tmp_path / "run2" / "final").exists()
