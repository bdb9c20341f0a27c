"""The single-process engine: clipping acts on the whole accumulated gradient, AdamW matches
torch's AdamW on the full batch, bf16 autocast accumulates like fp32, checkpoints are atomic."""

from __future__ import annotations

import pytest
import torch

from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.checkpoint import _atomic_dir, save_checkpoint
from exactrl.distributed.engine import SampleAccountingError, build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.workers.worker import Worker
from rl_helpers import sft_micro_batch_loss

COMPLETIONS = ["1", "2+2+0=04 #### 04", "#### 77", "9+9+0=18 1+1+1=03 #### 318", "x", "12345678901234567890", "ab",
               "#### 1"]


def examples(tokenizer):
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)]
    return encode_sft(rows, tokenizer, 256)


def step_params(model, tokenizer, exs, cfg, micro):
    engine = build_engine(model, cfg, total_steps=4)
    plan = plan_step([e.loss_tokens for e in exs], micro, cfg.train.loss_agg)
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share = sft_micro_batch_loss(model, engine, [exs[i] for i in mb], tokenizer.pad_token_id, plan.normalizer)
        engine.backward(loss, share, len(mb))
    stats = engine.step(plan)
    return [p.detach().clone() for p in model.parameters()], stats


def full_batch_grad(model, tokenizer, exs):
    """Independent reference: one padded batch, per-token NLL by hand, token-mean over the step."""
    width = max(len(e.input_ids) for e in exs)
    ids = torch.tensor([e.input_ids + [tokenizer.pad_token_id] * (width - len(e.input_ids)) for e in exs])
    attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in exs])
    mask = torch.tensor([e.loss_mask + [0] * (width - len(e.loss_mask)) for e in exs])[:, 1:].float()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    ((nll * mask).sum() / mask.sum()).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def rel_err(a, b):
    num = sum((x - y).norm() ** 2 for x, y in zip(a, b))
    return (num / sum(y.norm() ** 2 for y in b)).sqrt().item()


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_clipping_acts_on_the_full_accumulated_gradient(tokenizer, make_model, micro):
    ref = make_model(5)
    p0 = [p.detach().clone() for p in ref.parameters()]
    g = full_batch_grad(ref, tokenizer, examples(tokenizer))
    norm = torch.sqrt(sum((x**2).sum() for x in g)).item()
    clip = norm / 10  # clipping must scale the whole step's gradient by exactly 1/10
    cfg = load_config(SFTConfig, None, ["optim.name=sgd", "optim.lr=1.0", "optim.scheduler=constant",
                                        f"train.max_grad_norm={clip}",
                                         "train.global_batch_size=8", f"train.micro_batch_size={micro}"])
    got, stats = step_params(make_model(5), tokenizer, examples(tokenizer), cfg, micro)
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)
    expected = [p - x * (clip / norm) for p, x in zip(p0, g)]
    assert rel_err([a - b for a, b in zip(got, p0)], [e - b for e, b in zip(expected, p0)]) <= 1e-5


def test_adamw_accumulated_step_matches_torch_adamw_on_full_batch(tokenizer, make_model):
    ref = make_model(6)
    g = full_batch_grad(ref, tokenizer, examples(tokenizer))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt.step()
    expected = [p.detach().clone() for p in ref.parameters()]
    cfg = load_config(SFTConfig, None, ["optim.lr=1e-2", "optim.weight_decay=0.1", "optim.scheduler=constant",
                                         "train.max_grad_norm=0", "train.global_batch_size=8",
                                         "train.micro_batch_size=2"])
    model = make_model(6)
    p0 = [p.detach().clone() for p in model.parameters()]
    got, _ = step_params(model, tokenizer, examples(tokenizer), cfg, 2)
    assert rel_err([a - b for a, b in zip(got, p0)], [e - b for e, b in zip(expected, p0)]) <= 1e-5
    assert g  # the reference really had a gradient


def test_bf16_autocast_accumulation_agrees_with_one_pass(tokenizer, make_model):
    """bf16 changes the numbers, not the rule: 4 micro-batches vs 1, both under bf16 autocast.
    Different batch shapes round differently in bf16 (8-bit mantissa, ~4e-3 per rounding), so
    the bound is 5e-3, still far below what one dropped micro-batch of 8 would cause (~0.1+)."""
    ups = []
    for micro in (8, 2):
        cfg = load_config(SFTConfig, None, ["model.dtype=bf16", "optim.name=sgd", "optim.lr=1.0",
                                            "train.max_grad_norm=0",
                                             "train.global_batch_size=8", f"train.micro_batch_size={micro}"])
        model = make_model(7)
        p0 = [p.detach().clone() for p in model.parameters()]
        got, _ = step_params(model, tokenizer, examples(tokenizer), cfg, micro)
        assert all(p.dtype == torch.float32 for p in got)  # master weights stay fp32
        ups.append([a - b for a, b in zip(got, p0)])
    assert rel_err(ups[1], ups[0]) <= 5e-3
    dropped = [u * 0 for u in ups[0]]
    assert rel_err(dropped, ups[0]) > 0.5


def test_a_step_is_begun_with_its_micro_batch_count_and_held_to_it(tokenizer, make_model):
    """begin_step is the engine's only source for a step's count (DeepSpeed places its accumulation
    boundary from it): a backward without it, beyond it, or a count the plan does not have is refused."""
    exs = examples(tokenizer)
    cfg = load_config(SFTConfig, None, ["optim.name=sgd", "train.global_batch_size=8", "train.micro_batch_size=2"])
    model = make_model(8)
    engine = build_engine(model, cfg, total_steps=4)
    plan = plan_step([e.loss_tokens for e in exs], 4, "token-mean")

    def backward(mb):
        loss, share = sft_micro_batch_loss(model, engine, [exs[i] for i in mb], tokenizer.pad_token_id, plan.normalizer)
        engine.backward(loss, share, len(mb))

    with pytest.raises(SampleAccountingError, match="step 0: backward before begin_step"):
        backward(plan.micro_batches[0])
    with pytest.raises(SampleAccountingError, match="at least one micro-batch, the plan gives 0"):
        engine.begin_step(0)
    engine.begin_step(3)
    with pytest.raises(SampleAccountingError, match=r"begin_step\(2\) before the step begun with 3"):
        engine.begin_step(2)
    for mb in plan.micro_batches:
        backward(mb)
    with pytest.raises(SampleAccountingError,
                       match="begin_step announced 3 micro-batches, the plan and backward have 2"):
        engine.step(plan)
    # A count other than the configured accumulation (8 / 2 = 4) is the ordinary case, step after step.
    engine = build_engine(make_model(8), cfg, total_steps=4)
    model = engine.model
    for micro in (4, 1, 8):
        plan = plan_step([e.loss_tokens for e in exs], micro, "token-mean")
        engine.begin_step(len(plan.micro_batches))
        for mb in plan.micro_batches:
            backward(mb)
        assert engine.step(plan)["micro_batches"] == len(plan.micro_batches)


def test_checkpoint_write_is_atomic(tmp_path, tokenizer, make_model):
    model = make_model(8)
    cfg = load_config(SFTConfig, None, [])
    policy = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tokenizer.pad_token_id)
    ck = save_checkpoint(tmp_path / "checkpoint-1", tokenizer, {"policy": policy}, {"step": 1}, "sft")
    before = sorted(p.name for p in ck.iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt"} <= set(before)

    def crash(tmp):
        (tmp / "partial").write_text("half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _atomic_dir(ck, crash)
    assert sorted(p.name for p in ck.iterdir()) == before  # the previous checkpoint is intact
