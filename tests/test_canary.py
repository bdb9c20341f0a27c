"""The canary fires on every way a step can miscount its micro-batches, and on nothing else.

Faults are injected at the engine, where a backend bug would sit (DeepSpeed's CPU-offload
bug loses micro-batch gradients *after* backward ran): the sample accounting sees every
backward call, so only the canary can notice that a gradient went missing or was doubled.
"""

from __future__ import annotations

import logging

import pytest
import torch

from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import SingleEngine, build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses import AGG_MODES
from rl_helpers import sft_micro_batch_loss

COMPLETIONS = ["1", "2+2+0=04 #### 04", "#### 77", "9+9+0=18 1+1+1=03 #### 318", "x", "12345678901234567890", "ab",
               "#### 1"]


@pytest.fixture(scope="module")
def examples(tokenizer):
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)]
    return encode_sft(rows, tokenizer, 256)


def cfg(*extra):
    # only that mode reads it
    norm = ["train.loss_agg_norm=16"] if "train.loss_agg=seq-mean-token-sum-norm" in extra else []
    return load_config(SFTConfig, None, ["optim.name=sgd", "optim.lr=0.1", "train.global_batch_size=8",
                                         "train.micro_batch_size=2", *norm, *extra])


class DropsGradient(SingleEngine):
    """Backend fault: micro-batch ``victim``'s gradient is lost after its backward ran."""

    victim = 1

    def backward(self, loss, share, num_samples):
        if self._micro_seen != self.victim:
            return super().backward(loss, share, num_samples)
        params = [p for p in self.model.parameters()] + [self.canary.param]
        saved = [None if p.grad is None else p.grad.clone() for p in params]
        super().backward(loss, share, num_samples)
        for p, g in zip(params, saved):
            p.grad = g


class DuplicatesGradient(SingleEngine):
    """Backend fault: micro-batch 0's gradient is accumulated twice."""

    def backward(self, loss, share, num_samples):
        if self._micro_seen == 0:
            (loss + self.canary.term(share)).backward(retain_graph=True)
        super().backward(loss, share, num_samples)


def run_step(model, tokenizer, examples, config, engine_cls=None, mean_of_means=False):
    engine = engine_cls(model, config.model, config.train, config.optim, config.audit,
                        1) if engine_cls else build_engine(model, config, 1)
    t = config.train
    plan = plan_step([e.loss_tokens for e in examples], t.micro_batch_size, t.loss_agg, t.loss_agg_norm)
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        batch = [examples[i] for i in mb]
        # The "mean of means" bug: each micro-batch normalised by its own counts.
        norm = plan_step([e.loss_tokens for e in batch], len(batch), t.loss_agg,
                         t.loss_agg_norm).normalizer if mean_of_means else plan.normalizer
        loss, share = sft_micro_batch_loss(model, engine, batch, tokenizer.pad_token_id, norm)
        engine.backward(loss, share, len(mb))
    return engine, plan


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_canary_reads_exactly_one_on_a_correct_step(make_model, tokenizer, examples, mode, micro):
    engine, plan = run_step(make_model(0), tokenizer, examples, cfg(f"train.loss_agg={mode}",
                                                                    f"train.micro_batch_size={micro}"))
    assert engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("fault,expected", [(DropsGradient, "<1"), (DuplicatesGradient, ">1"), ("mean_of_means", ">1")])
def test_canary_stops_the_step_on_injected_faults(make_model, tokenizer, examples, fault, expected):
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    engine, plan = run_step(model, tokenizer, examples, cfg(), engine_cls=None if fault == "mean_of_means" else fault,
                            mean_of_means=fault == "mean_of_means")
    with pytest.raises(CanaryError) as err:
        engine.step(plan)
    value = float(err.value.args[0].split("carries ")[1].split(" ")[0])
    assert (value < 0.99) if expected == "<1" else (value > 1.01)
    assert ("backend=single" in str(err.value) and "4 micro-batches" in str(err.value)
            and torch.__version__ in str(err.value))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing applied


def test_warn_policy_logs_and_applies_the_step(make_model, tokenizer, examples, caplog):
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    engine, plan = run_step(model, tokenizer, examples, cfg("audit.canary=warn"), engine_cls=DropsGradient)
    with caplog.at_level(logging.WARNING, logger="exactrl.checks.canary"):
        stats = engine.step(plan)
    assert stats["canary"] < 0.99 and "canary failed" in caplog.text
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_canary_never_changes_the_update_and_off_disables_it(make_model, tokenizer, examples):
    params = {}
    for policy in ("error", "off"):
        model = make_model(0)
        engine, plan = run_step(model, tokenizer, examples, cfg(f"audit.canary={policy}"))
        stats = engine.step(plan)
        params[policy] = [p.detach().clone() for p in model.parameters()]
        assert (stats["canary"] is None) == (policy == "off")
        assert not any("canary" in name for name in model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(params["error"], params["off"]))


def test_canary_off_accepts_a_bare_yaml_off():
    assert cfg("audit.canary=off").audit.canary == "off"
