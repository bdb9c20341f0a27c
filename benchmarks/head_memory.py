"""Peak memory of one SFT micro-batch with the output head whole or in chunks (issue 38).

usage: .venv/bin/python benchmarks/head_memory.py [--tokens 16384] [--vocab 32000] [--chunks 0,2048]

One micro-batch of ``--tokens`` tokens (rows of 512 packed into one row, loss on every
target) through exactrl's Worker -- forward, the per-token log-probs, the SFT loss, backward --
on a 2-layer Llama with hidden 256 and a ``--vocab`` vocabulary, fp32 on the CPU, so the
head's [tokens x vocab] logits (2.1 GB in fp32 at 16k x 32k) dominate. Each setting of
train.logprob_chunk_size runs in its own process; its peak RSS (ru_maxrss) less the RSS
before the micro-batch is the micro-batch's peak. Prints ``PEAK chunk=N ...`` per setting and
``SAVED chunk=N: X GB`` against chunk 0 (the model's full logits), and ``RATIO peak_rss
full/chunked``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

ROW = 512


def one(tokens: int, vocab: int, chunk: int) -> dict:
    import torch
    import transformers

    from exactrl.algorithms.sft import sft_objective
    from exactrl.config import SFTConfig, load_config
    from exactrl.data.batch import Sample
    from exactrl.distributed.engine import build_engine
    from exactrl.distributed.step_plan import plan_step
    from exactrl.losses.objective import Metrics
    from exactrl.models import packing
    from exactrl.workers.worker import Worker

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=688, tie_word_embeddings=False)
    model = packing.enable(transformers.LlamaForCausalLM(config)).train()
    cfg = load_config(SFTConfig, None, [f"train.logprob_chunk_size={chunk}", "audit.canary=off"])
    engine = build_engine(model, cfg, total_steps=1)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, vocab, (1,), generator=g).tolist(),
                      torch.randint(3, vocab, (ROW - 1,), generator=g).tolist()) for _ in range(tokens // ROW)]
    plan = plan_step([s.num_targets for s in samples], len(samples), "token-mean")
    objective = sft_objective(plan.normalizer.mode, plan.normalizer.norm_len)
    worker = Worker("policy", model, engine, pad_id=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    loss, _, _ = worker.micro_batch(samples, objective, dict.fromkeys(objective.groups(), plan.normalizer), Metrics())
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"chunk": chunk, "peak_gb": peak / 2**20, "micro_batch_gb": (peak - before) / 2**20, "seconds": seconds,
            "loss": loss.item(), "grad_norm": grad.norm().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunks", default="0,2048", help="train.logprob_chunk_size values, the first the baseline")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.tokens, a.vocab, a.one)))
        return
    results = []
    for chunk in (int(c) for c in a.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, "--tokens", str(a.tokens), "--vocab", str(a.vocab), "--one",
                              str(chunk)], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        results.append(r)
        print(f"PEAK chunk={chunk}: process {r['peak_gb']:.2f} GB, micro-batch {r['micro_batch_gb']:.2f} GB, "
              f"{r['seconds']:.1f} s, loss {r['loss']:.6f}, grad norm {r['grad_norm']:.6f}", flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"SAVED chunk={r['chunk']}: {base['peak_gb'] - r['peak_gb']:.2f} GB of peak RSS "
              f"(fp32 logits: {a.tokens * a.vocab * 4 / 2**30:.2f} GB)")
        print(f"RATIO peak_rss full/chunked chunk={r['chunk']} = {base['peak_gb'] / r['peak_gb']:.2f}")
        print(f"loss |difference| {abs(base['loss'] - r['loss']):.2e}, grad norm relative difference "
              f"{abs(base['grad_norm'] - r['grad_norm']) / base['grad_norm']:.2e}")


if __name__ == "__main__":
    main()
