"""Activation checkpointing (train.gradient_checkpointing) composes with LoRA and the canary: one
checkpoint per decoder layer, off by default; a LoRA model's adapter gradients are those of the
backward that keeps its activations; the canary reads exactly 1 and still stops a step that lost
or doubled a micro-batch. (Packed and padded rows: tests/test_memory_knobs.py; FSDP2, with the
head in chunks too: tests/dist/equivalence.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.modeling_utils

from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from rl_helpers import sft_micro_batch_loss
from test_canary import DropsGradient, DuplicatesGradient, cfg, examples, run_step

pytest.importorskip("peft")
from test_lora import with_adapters  # after the skip: it imports peft

__all__ = ["examples"]  # test_canary's fixture, used here


@pytest.fixture
def checkpoints(monkeypatch):
    """The number of checkpointed calls Hugging Face makes, counted where it binds torch's checkpoint."""
    calls = []
    checkpoint = transformers.modeling_utils.checkpoint
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda fn, *a, **k: calls.append(fn.args[0]) or checkpoint(fn, *a, **k))
    return calls


def one_step_of_backward(model, engine, examples, pad_id, packed=True):
    plan = plan_step([e.loss_tokens for e in examples], 4, "token-mean")
    for mb in plan.micro_batches:
        loss, _ = sft_micro_batch_loss(model, engine, [examples[i] for i in mb], pad_id, plan.normalizer, packed)
        loss.backward()
    return len(plan.micro_batches)


def test_off_by_default_and_one_checkpoint_per_decoder_layer(make_model, tokenizer, examples, checkpoints):
    assert load_config(SFTConfig, None, []).train.gradient_checkpointing is False
    for on in (False, True):
        model = make_model(0)
        engine = build_engine(model, cfg("audit.canary=off", f"train.gradient_checkpointing={str(on).lower()}"), 1)
        norm, seen = model.model.norm, []
        forward = norm.forward
        norm.forward = lambda *a, seen=seen, forward=forward, **k: seen.append(1) or forward(*a, **k)
        checkpoints.clear()
        micro = one_step_of_backward(model, engine, examples, tokenizer.pad_token_id)
        # each decoder layer once per micro-batch forward, nothing else (the final norm ran once, not again)
        assert checkpoints == (list(model.model.layers) * micro if on else [])
        assert len(seen) == micro


@pytest.mark.parametrize("packed,dropout", [(True, 0.0), (False, 0.0), (True, 0.1)])
def test_lora_adapter_gradients_with_checkpointing_equal_the_stored_backward(make_model, tokenizer, examples, packed,
                                                                             dropout, checkpoints):
    """With the adapters' dropout on too: the recomputation must draw the forward's masks again."""
    base = with_adapters(make_model(0), dropout=dropout)
    grads = {}
    for on in (False, True):
        model = copy.deepcopy(base)
        engine = build_engine(model, cfg("audit.canary=off", f"train.gradient_checkpointing={str(on).lower()}"), 1)
        checkpoints.clear()
        torch.manual_seed(0)
        one_step_of_backward(model, engine, examples, tokenizer.pad_token_id, packed)
        assert bool(checkpoints) == on
        grads[on] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)  # the base stays frozen
    layers = len(base.base_model.model.model.layers)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) == layers * 7 * 2  # A, B of 7 linears
    for name, g in grads[False].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[True][name], g, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("fault", [None, DropsGradient, DuplicatesGradient])
def test_the_canary_under_checkpointing(make_model, tokenizer, examples, checkpoints, lora, fault):
    model = make_model(0)
    model = with_adapters(model) if lora else model
    before = [p.detach().clone() for p in model.parameters()]
    engine, plan = run_step(model, tokenizer, examples, cfg("train.gradient_checkpointing=true"), engine_cls=fault)
    layers = model.base_model.model.model.layers if lora else model.model.layers
    assert checkpoints == list(layers) * len(plan.micro_batches)
    if fault is None:
        assert engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)
        return
    with pytest.raises(CanaryError, match="canary failed at optimizer step 0") as err:
        engine.step(plan)
    value = float(err.value.args[0].split("carries ")[1].split(" ")[0])
    assert value < 0.99 if fault is DropsGradient else value > 1.01
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing applied
