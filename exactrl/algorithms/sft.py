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

from exactrl.algorithms.builtin import resolve
from exactrl.algorithms.common import check_data_size, check_world, seed_everything, steps_for
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
from exactrl.run.context import RunContext
from exactrl.run.evaluation import eval_data, load_eval_set
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.load import load_model
from exactrl.workers.worker import Worker


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
    logprobs = mb.repad(token_logprobs(logits, mb.inputs["input_ids"], chunk=engine.logprob_chunk))
    mask = collate_sft(examples, pad_id, engine.device)["loss_mask"]
    return aggregate(sft_loss(logprobs), mask, normalizer), canary_share(mask, normalizer)


def train_sft(cfg: SFTConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "sft", final_name: str = "final") -> SFTResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t = cfg.train
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "sft_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path)
    # All data is read and checked before the model loads: a bad row fails in seconds.
    examples = encode_sft(read_jsonl(train_path), tok, cfg.data.max_length)
    eval_set = load_eval_set(cfg, tok, eval_path)
    steps = steps_for(t, len(examples), t.global_batch_size)
    check_data_size(len(examples), t.global_batch_size, "samples", train_path)
    if t.resume_from:
        check_resume(cfg, "sft", steps)
    ctx = RunContext(cfg, "sft", phase, run_dir, {"train": train_path, "eval": eval_path}, tok, eval_set)
    model = load_model(cfg, model_path, ctx.run_dir, phase, "policy", cfg.data.max_length, checkpoint=t.resume_from)
    policy = Worker("policy", model, build_engine(model, cfg, steps), pad_id=tok.pad_token_id, packed=t.padding_free)
    start = resume(t.resume_from, policy.engine)["step"] if t.resume_from else 0
    sampler = StepSampler(len(examples), t.global_batch_size, t.seed)
    norm_len = t.loss_agg_norm or cfg.data.max_length

    def loss_fn(worker, chunk, normalizer):
        loss, share = sft_micro_batch_loss(worker.model, worker.engine, chunk, tok.pad_token_id, normalizer, t.padding_free)
        return loss, share, {}

    trained_tokens, t0 = 0, time.perf_counter()
    ctx.start(steps, start)
    for step in range(start + 1, steps + 1):
        # the step's global batch (independent of micro-batch size and ranks), planned, then one verified step
        batch = [examples[i] for i in sampler.batch(step - 1)]
        plan = plan_step([e.loss_tokens for e in batch], t.micro_batch_size, t.loss_agg, norm_len,
                         lengths=[len(e.input_ids) for e in batch], world_size=policy.engine.world_size, rank=policy.engine.rank)
        result = policy.train_step(batch, plan, loss_fn)
        trained_tokens += sum(len(e.input_ids) for e in batch)
        if ctx.logs(step):
            ctx.write(step, {"loss": result.loss, "epoch": sampler.epoch_of(step),
                             "tokens_per_s": trained_tokens / (time.perf_counter() - t0),
                             "loss_tokens": plan.normalizer.num_tokens, **result.stats})
        ctx.step_done(step, {"policy": policy}, {"step": step}, {"loss": f"{result.loss:.4f}"})
    seconds = time.perf_counter() - t0
    final = ctx.finish({final_name: policy})
    return SFTResult(ctx.run_dir, final, steps, seconds, trained_tokens)
