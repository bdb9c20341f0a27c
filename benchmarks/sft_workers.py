"""One measured SFT run of exactrl or of TRL, for benchmarks/bench.py; prints one JSON line.

usage: python sft_workers.py {exactrl,trl} MODEL_DIR DATA.jsonl BATCH THREADS OUT_DIR

Both train one epoch over the same rows (prompt/completion JSONL, loss on completion tokens)
from the same initial model, in fp32, without gradient checkpointing, AdamW lr 1e-4 constant,
gradient clipping at 1.0, micro-batch = batch (no accumulation). Reported: trained tokens
(non-padding prompt + completion tokens of every row, as each system tokenised them), the
training loop's wall time (model and data loading excluded), and the process's peak RSS.
This file runs under exactrl's .venv (exactrl) or under .venv-bench (TRL): it imports only
what its side needs.
"""

from __future__ import annotations

import sys

from worker_common import run, trl_clock


def rates(tokens: int, seconds: float, steps: int) -> dict:
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds}


def run_exactrl(model_dir: str, data: str, batch: int, out: str) -> dict:
    from exactrl.algorithms.sft import train_sft
    from exactrl.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, None, [f"model.path={model_dir}", f"data.train={data}", "data.eval=null",
                                        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
                                        "train.epochs=1",
                                        "train.max_grad_norm=1.0", "train.log_every=1000000", "optim.name=adamw",
                                        "optim.lr=1e-4",
                                        "optim.scheduler=constant", "optim.warmup_steps=0", f"output_dir={out}"])
    result = train_sft(cfg)
    return rates(result.trained_tokens, result.seconds, result.steps)


def run_trl(model_dir: str, data: str, batch: int, out: str) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    ds = load_dataset("json", data_files=data, split="train")
    clock = trl_clock()
    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                     num_train_epochs=1,
                     learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                     weight_decay=0.0,
                     bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to=[],
                     save_strategy="no",
                     logging_steps=1000000, dataloader_num_workers=0, max_length=256, completion_only_loss=True,
                     packing=False, seed=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[clock])
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    trainer.train()
    return rates(tokens, clock.end - clock.begin, trainer.state.global_step)


def main() -> None:
    system, model_dir, data, batch, threads, out = sys.argv[1:7]
    run({"exactrl": run_exactrl, "trl": run_trl}, system, int(threads), model_dir, data, int(batch), out)


if __name__ == "__main__":
    main()
