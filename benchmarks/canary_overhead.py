"""Canary overhead: SFT optimizer steps with the canary on vs off, same process, interleaved,
on each backend at world size 1 (the single engine, FSDP2, DeepSpeed ZeRO-2 with the
optimizer offloaded to CPU -- where the canary reads the offloaded fp32 gradient -- and ZeRO-3).

usage: DS_ACCELERATOR=cpu .venv/bin/python benchmarks/canary_overhead.py [pairs] [warmup]
The two run side by side, one step each in turn on the same batch; prints median step times,
the quartiles of the per-pair time ratio and `RATIO canary_on/off[<backend>] = X.XXX` (the
median ratio; goal: <= 1.01). benchmarks/bench.py calls measure() for the single engine on its
own model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

from exactrl.algorithms.sft import demonstration, sft_objective
from exactrl.config import SFTConfig, load_config
from exactrl.data.batching import StepSampler
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import read_jsonl
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.workers.worker import Worker

LAYOUTS = {
    "single": [],
    "fsdp2": ["distributed.backend=fsdp2"],
    "deepspeed-zero2-offload": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2",
                                "deepspeed.offload_optimizer=cpu"],
    "deepspeed-zero3": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"],
}


class Trainer:
    """One SFT setup (model + engine) for a layout and canary policy, stepped on demand."""

    def __init__(self, layout: str, policy: str, model_path, examples, tok, steps: int, batch: int, micro: int):
        cfg = load_config(SFTConfig, None, [*LAYOUTS[layout], f"audit.canary={policy}",
                                            f"train.global_batch_size={batch}",
                                            f"train.micro_batch_size={micro}"])
        torch.manual_seed(0)
        self.model, self.samples, self.micro = load_causal_lm(str(model_path)), [demonstration(
            e) for e in examples], micro
        self.worker = Worker("policy", self.model, build_engine(self.model, cfg, steps), pad_id=tok.pad_token_id)
        self.objective = sft_objective("token-mean", None)
        self.sampler = StepSampler(len(examples), batch, 0)

    def step(self, step: int) -> float:
        batch = [self.samples[i] for i in self.sampler.batch(step)]
        t0 = time.perf_counter()
        self.worker.train_step(batch, plan_samples(batch, self.micro, "token-mean", sort=True), self.objective)
        return time.perf_counter() - t0


def measure(layout: str, model_path, examples, tok, pairs: int = 60, warmup: int = 3, batch: int = 64,
            micro: int = 16) -> dict:
    """Median step times with the canary on and off, and the quartiles of the paired on/off ratio."""
    on, off = (Trainer(layout, policy, model_path, examples, tok, pairs + warmup, batch, micro) for policy in (
        "error", "off"))
    # Step by step, alternating which goes first, both on the same batch: machine noise
    # (this is a VM) hits both alike, and each pair gives one ratio.
    ratios, t_on, t_off = [], [], []
    for step in range(pairs + warmup):
        pair = (on.step(step), off.step(step)) if step % 2 == 0 else tuple(reversed((off.step(step), on.step(step))))
        if step >= warmup:
            t_on.append(pair[0]), t_off.append(pair[1]), ratios.append(pair[0] / pair[1])
    return {"on_ms": 1e3 * statistics.median(t_on), "off_ms": 1e3 * statistics.median(t_off),
            "quartiles": statistics.quantiles(ratios, n=4), "pairs": pairs}


def main(steps: int = 60, warmup: int = 3) -> None:
    import transformers

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    paths = ensure_builtin(BuiltinSpec(n_sft=2000, n_rl=10, n_eval=10), cache=tempfile.mkdtemp())
    tok = load_tokenizer(paths.model)
    examples = encode_sft(read_jsonl(paths.sft_train), tok, 256)
    for layout in LAYOUTS:
        if layout.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            print(f"{layout}: deepspeed not installed, skipped")
            continue
        r = measure(layout, paths.model, examples, tok, steps, warmup)
        q = r["quartiles"]
        print(f"{layout}: median step canary on {r['on_ms']:.2f} ms, off {r['off_ms']:.2f} ms; paired on/off ratio "
              f"quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} ({steps} pairs, tiny built-in model, batch 64 x 4 "
              "micro-batches)")
        print(f"RATIO canary_on/off[{layout}] = {q[1]:.3f}", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
