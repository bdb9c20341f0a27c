"""One measured SFT run of exactrl or of TRL, for benchmarks/bench.py and gpu_bench.py; prints one JSON line.

usage: python sft_workers.py {exactrl,trl} MODEL_DIR DATA.jsonl BATCH THREADS OUT_DIR [OPTIONS_JSON]

Both train one epoch over the same rows (prompt/completion JSONL, loss on completion tokens)
from the same initial model (fp32 master weights), without gradient checkpointing, AdamW
constant lr, gradient clipping at 1.0, micro-batch = batch (no accumulation). Options
(worker_common.OPTIONS; default bench.py's CPU run): ``dtype`` fp32 or bf16 (autocast over the
fp32 weights: exactrl model.dtype=bf16, TRL bf16=True), ``device`` cpu or cuda, ``max_length``,
``lr`` (1e-4), ``skip_steps`` and ``exactrl_set`` (key=value overrides of exactrl's side only).
Reported: trained tokens (non-padding prompt + completion tokens, as each system tokenised them)
and the training loop's wall time (model and data loading excluded): with ``skip_steps`` = k > 0,
only the steps after the k-th (from the end of step k to the end of the last, each end stamped
after a device sync by a global optimizer-step hook, the same on both sides), so that warm-up
(allocator growth, kernel autotuning) is not timed. This file runs under exactrl's .venv
(exactrl) or under .venv-bench (TRL): it imports only what its side needs.
"""

from __future__ import annotations

import json
import sys

from worker_common import Device, count_optimizer_steps, options, run, trl_clock


def rates(tokens: int, seconds: float, steps: int, **extra) -> dict:
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds, **extra}


def after_skip(step_tokens: list[int], stamps: list[float], skip: int) -> dict:
    """Tokens/s over steps skip+1..N from each step's tokens and the time its optimizer step ended."""
    if len(step_tokens) != len(stamps) or len(stamps) <= skip:
        raise SystemExit(f"{len(step_tokens)} steps with token counts, {len(stamps)} optimizer steps: need the same "
                         f"number, more than skip_steps={skip}")
    tokens, seconds = sum(step_tokens[skip:]), stamps[-1] - stamps[skip - 1]
    return rates(tokens, seconds, len(stamps), timed_steps=len(stamps) - skip, all_tokens=sum(step_tokens))


def run_exactrl(model_dir: str, data: str, batch: int, out: str, opt: dict) -> dict:
    from exactrl.algorithms.sft import train_sft
    from exactrl.config import SFTConfig, load_config

    skip = opt["skip_steps"]
    cfg = load_config(SFTConfig, None, [f"model.path={model_dir}", f"data.train={data}", "data.eval=null",
                                        f"data.max_length={opt['max_length']}", f"model.dtype={opt['dtype']}",
                                        f"distributed.device={opt['device']}",
                                        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
                                        "train.epochs=1", "train.max_grad_norm=1.0",
                                        f"train.log_every={1 if skip else 1000000}", "optim.name=adamw",
                                        f"optim.lr={opt.get('lr', 1e-4)}", "optim.scheduler=constant",
                                        "optim.warmup_steps=0", f"output_dir={out}", *opt["exactrl_set"]])
    counter = count_optimizer_steps(Device(opt["device"]))
    result = train_sft(cfg)
    if not skip:
        return rates(result.trained_tokens, result.seconds, result.steps)
    # metrics.jsonl's cumulative count of trained tokens, step by step
    totals = [r["flops_trained_tokens"] for r in map(json.loads, (result.run_dir / "metrics.jsonl").read_text()
                                                     .splitlines()) if "flops_trained_tokens" in r]
    return after_skip([b - a for a, b in zip([0, *totals], totals)], counter["times"], skip)


def run_trl(model_dir: str, data: str, batch: int, out: str, opt: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    ds = load_dataset("json", data_files=data, split="train")
    clock = trl_clock()
    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                     num_train_epochs=1, learning_rate=opt.get("lr", 1e-4), lr_scheduler_type="constant",
                     warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, bf16=opt["dtype"] == "bf16", fp16=False,
                     gradient_checkpointing=False, use_cpu=opt["device"] == "cpu", report_to=[], save_strategy="no",
                     logging_steps=1000000, dataloader_num_workers=0, max_length=opt["max_length"],
                     completion_only_loss=True, packing=False, seed=0, disable_tqdm=True)
    counter = count_optimizer_steps(Device(opt["device"]))
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[clock])
    # each training forward's real (unpadded) tokens, kept on the device until the end (no sync per step)
    masks: list = []
    trainer.model.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"].sum()),
                                            with_kwargs=True)
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    trainer.train()
    if not opt["skip_steps"]:
        return rates(tokens, clock.end - clock.begin, trainer.state.global_step)
    return after_skip([int(m) for m in torch.stack(masks).tolist()], counter["times"], opt["skip_steps"])


def main() -> None:
    system, model_dir, data, batch, threads, out = sys.argv[1:7]
    opt = options(sys.argv[7:])
    run({"exactrl": run_exactrl, "trl": run_trl}, system, int(threads), model_dir, data, int(batch), out, opt,
        device=opt["device"])


if __name__ == "__main__":
    main()
