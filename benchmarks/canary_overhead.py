"""Canary overhead: SFT optimizer steps with the canary on vs off, same process, interleaved,
on each backend at world size 1 (the single engine, FSDP2, DeepSpeed ZeRO-2 with the
optimizer offloaded to CPU -- where the canary reads the offloaded fp32 gradient -- and ZeRO-3).

usage: DS_ACCELERATOR=cpu .venv/bin/python benchmarks/canary_overhead.py [steps_per_round] [rounds]
Prints the median step time of each and `RATIO canary_on/off[<backend>] = X.XXX` (goal: <= 1.01).
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

from exactrl.algorithms.sft import sft_micro_batch_loss
from exactrl.config import SFTConfig, load_config
from exactrl.data.batching import StepSampler
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import read_jsonl
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin


LAYOUTS = {
    "single": [],
    "fsdp2": ["distributed.backend=fsdp2"],
    "deepspeed-zero2-offload": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
    "deepspeed-zero3": ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"],
}


def time_steps(layout: str, policy: str, paths, examples, tok, steps: int, start: int) -> list[float]:
    cfg = load_config(SFTConfig, None, [*LAYOUTS[layout], f"audit.canary={policy}", "train.global_batch_size=64",
                                        "train.micro_batch_size=16"])
    torch.manual_seed(0)
    model = load_causal_lm(paths.model)
    engine = build_engine(model, cfg, steps)
    sampler = StepSampler(len(examples), 64, 0)
    out = []
    for step in range(start, start + steps):
        batch = [examples[i] for i in sampler.batch(step)]
        t0 = time.perf_counter()
        plan = plan_step([e.loss_tokens for e in batch], 16, "token-mean", lengths=[len(e.input_ids) for e in batch])
        for mb in plan.micro_batches:
            loss, share = sft_micro_batch_loss(model, engine, [batch[i] for i in mb], tok.pad_token_id, plan.normalizer)
            engine.backward(loss, share, len(mb))
        engine.step(plan)
        out.append(time.perf_counter() - t0)
    return out


def main(steps: int = 20, rounds: int = 5) -> None:
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
        times = {"on": [], "off": []}
        for r in range(rounds):  # interleave so machine noise hits both alike
            for policy, key in (("error", "on"), ("off", "off")) if r % 2 == 0 else (("off", "off"), ("error", "on")):
                times[key] += time_steps(layout, policy, paths, examples, tok, steps, r * steps)[2:]  # drop warm-up steps
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"{layout}: median step canary on {1e3 * on:.2f} ms, off {1e3 * off:.2f} ms "
              f"({len(times['on'])} steps each, tiny built-in model, batch 64 x 4 micro-batches)")
        print(f"RATIO canary_on/off[{layout}] = {on / off:.3f}", flush=True)

if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
