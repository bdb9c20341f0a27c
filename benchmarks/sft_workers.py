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

import json
import resource
import sys
import time


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_exactrl(model_dir: str, data: str, batch: int, out: str) -> dict:
    from exactrl.algorithms.sft import train_sft
    from exactrl.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, None, [f"model.path={model_dir}", f"data.train={data}", "data.eval=null",
                                        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", "train.epochs=1",
                                        "train.max_grad_norm=1.0", "train.log_every=1000000", "optim.name=adamw", "optim.lr=1e-4",
                                        "optim.scheduler=constant", "optim.warmup_steps=0", f"output_dir={out}"])
    result = train_sft(cfg)
    return {"system": "exactrl", "tokens": result.trained_tokens, "seconds": result.seconds, "steps": result.steps}


def run_trl(model_dir: str, data: str, batch: int, out: str) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    ds = load_dataset("json", data_files=data, split="train")
    times = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times["start"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kw):
            times["end"] = time.perf_counter()

    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_train_epochs=1,
                     learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
                     bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no",
                     logging_steps=1000000, dataloader_num_workers=0, max_length=256, completion_only_loss=True,
                     packing=False, seed=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    trainer.train()
    return {"system": "trl", "tokens": tokens, "seconds": times["end"] - times["start"], "steps": trainer.state.global_step}


def main() -> None:
    system, model_dir, data, batch, threads, out = sys.argv[1:7]
    import torch

    torch.set_num_threads(int(threads))
    row = (run_exactrl if system == "exactrl" else run_trl)(model_dir, data, int(batch), out)
    row.update(tokens_per_s=row["tokens"] / row["seconds"], peak_rss_mb=peak_rss_mb(), threads=int(threads),
               torch=torch.__version__)
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
