"""Supervised fine-tuning: next-token loss on completion tokens, exact gradient accumulation.

Per optimizer step:
  1. the sampler draws the global batch (independent of micro-batch size);
  2. the step plan counts its loss tokens and fixes the normaliser before any backward;
  3. each micro-batch backpropagates its exact share of the step loss;
  4. the engine checks every sample was seen once, clips the full gradient and steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from exactrl.algorithms.common import (after_step, check_data_size, check_world, eval_data, finish, load_eval_set,
                                      load_model, open_run, progress, seed_everything, steps_for)
from exactrl.algorithms.resume import check_resume
from exactrl.config.schema import SFTConfig
from exactrl.data.batching import StepSampler, collate_sft
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import read_jsonl
from exactrl.distributed.checkpoint import resume
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses import aggregate, canary_share
from exactrl.losses.token_losses import sft_loss, token_logprobs
from exactrl.models.loading import load_tokenizer
from exactrl.models.packing import model_batch
from exactrl.tasks.builtin import BuiltinSpec, resolve


@dataclass
class SFTResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    trained_tokens: int


def sft_micro_batch_loss(model, engine, examples, pad_id: int, normalizer, packed: bool = True):
    """Forward one micro-batch (``packed``: padding-free, see exactrl/models/packing.py); return
    its part of the step loss (not yet backpropagated) and its canary share."""
    mb = model_batch(model, [e.input_ids for e in examples], pad_id, packed)
    with engine.autocast():
        logits = engine.forward(model, **mb.inputs).logits
    logprobs = mb.repad(token_logprobs(logits, mb.inputs["input_ids"]))
    mask = collate_sft(examples, pad_id)["loss_mask"]
    return aggregate(sft_loss(logprobs), mask, normalizer), canary_share(mask, normalizer)


def train_sft(cfg: SFTConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "sft", final_name: str = "final") -> SFTResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "sft_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path)
    # All data is read and checked before the model loads: a bad row fails in seconds.
    examples = encode_sft(read_jsonl(train_path), tok, cfg.data.max_length)
    eval_set = load_eval_set(cfg, tok, eval_path)
    steps = steps_for(cfg.train, len(examples), cfg.train.global_batch_size)
    check_data_size(len(examples), cfg.train.global_batch_size, "samples", train_path)
    if cfg.train.resume_from:
        check_resume(cfg, "sft", steps)
    run_dir, log = open_run(cfg, "sft", run_dir, {"train": train_path, "eval": eval_path})
    model = load_model(cfg, model_path, run_dir, phase, "policy", cfg.data.max_length, checkpoint=cfg.train.resume_from)
    engine = build_engine(model, cfg, steps)
    start = resume(cfg.train.resume_from, engine)["step"] if cfg.train.resume_from else 0
    sampler = StepSampler(len(examples), cfg.train.global_batch_size, cfg.train.seed)
    norm_len = cfg.train.loss_agg_norm or cfg.data.max_length

    trained_tokens, t0 = 0, time.perf_counter()
    bar = progress(steps, phase, start)
    for step in range(start, steps):
        batch = [examples[i] for i in sampler.batch(step)]
        plan = plan_step([e.loss_tokens for e in batch], cfg.train.micro_batch_size, cfg.train.loss_agg, norm_len,
                         lengths=[len(e.input_ids) for e in batch], world_size=engine.world_size, rank=engine.rank)
        step_loss = 0.0
        for mb in plan.micro_batches:
            loss, share = sft_micro_batch_loss(model, engine, [batch[i] for i in mb], tok.pad_token_id, plan.normalizer,
                                               cfg.train.padding_free)
            engine.backward(loss, share, num_samples=len(mb))
            step_loss += loss.item()
        stats = engine.step(plan)
        step_loss = engine.sum_over_ranks(step_loss)
        trained_tokens += sum(len(e.input_ids) for e in batch)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}")
        if (step + 1) % cfg.train.log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - t0
            log.write({"phase": phase, "step": step + 1, "loss": step_loss, "epoch": sampler.epoch_of(step + 1),
                       "tokens_per_s": trained_tokens / elapsed, "loss_tokens": plan.normalizer.num_tokens, **stats})
        after_step(cfg, phase, step + 1, steps, model, tok, engine, eval_set, log, run_dir, bar, {"step": step + 1})
    bar.close()
    seconds = time.perf_counter() - t0
    final = finish(cfg, phase, steps, model, tok, engine, eval_set, log, run_dir, final_name)
    return SFTResult(run_dir, final, steps, seconds, trained_tokens)
