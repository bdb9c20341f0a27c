"""exactrl's decode loop against Hugging Face's ``generate`` on the same model, prompts and draws
(benchmarks/bench.py's ``decode`` part; also runnable alone).

usage: .venv/bin/python benchmarks/decode_speed.py MODEL_DIR RL_JSONL [--prompts N] [--group G] [--max-new T] [--reps R]

Both sides decode the same left-padded batch of N prompts x G responses, sampled at temperature
1 (and once greedily), from the same per-row seeds: ``exactrl.rollout.hf.sample`` (the loop: the model's
own cache from its config, key/value layers pre-allocated, finished rows leaving the batch) and
``sample_with_generate`` (``model.generate`` with the same sampler and nothing of the model's
generation config), and ``static`` (exactrl/rollout/static_decode.py: the static-shape step, replayed
from a CUDA graph on CUDA; rollout.decode=graphs). They alternate rep by rep; generated tokens per
second, medians with min and max. Prints ``RATIO decode_tokens_per_s loop/generate`` and
``RATIO decode_tokens_per_s static/loop``; the device is the model's (``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def measure(model_dir, rl_data, prompts: int, group: int, max_new: int, reps: int, device: str = "cpu") -> dict:
    from exactrl.data.encode import encode_prompts
    from exactrl.data.jsonl import read_jsonl
    from exactrl.models.loading import load_causal_lm, load_tokenizer
    from exactrl.rollout.generator import prompt_seeds
    from exactrl.rollout.hf import sample, sample_with_generate
    from exactrl.rollout.static_decode import sample_static

    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), trainable=False).eval().to(device)
    ids = [p.input_ids for p in encode_prompts(read_jsonl(str(rl_data))[:prompts], tok, 256) for _ in range(group)]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)
    kw = {"max_new_tokens": max_new, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    fns = {"loop": sample, "generate": sample_with_generate,
           "static": lambda *a, **k: sample_static(*a, temperature=1.0, top_p=1.0, top_k=0, **k)}
    out: dict = {name: {"sampled": [], "greedy": []} for name in fns}
    tokens = {}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for rep in range(reps + 1):  # rep 0 warms both up and is not counted
        for name in (fns if rep % 2 == 0 else list(fns)[::-1]):
            for mode in ("sampled", "greedy"):
                seeds = None if mode == "greedy" else prompt_seeds(rep, positions=range(len(ids)))
                sync()
                t0 = time.perf_counter()
                got, _ = fns[name](model, input_ids, attention, greedy=mode == "greedy", seeds=seeds, **kw)
                sync()
                seconds = time.perf_counter() - t0
                n = int(sum((row.index(kw["eos"]) + 1) if kw["eos"] in row else max_new for row in got.tolist()))
                tokens[(name, mode, rep)] = got
                if rep:
                    out[name][mode].append(n / seconds)
    # Sampled too: each row's draws are keyed by its seed, whatever rows leave the loop's batch.
    same = all(torch.equal(tokens[("loop", m, r)], tokens[(other, m, r)]) for m in ("sampled", "greedy")
               for r in range(reps + 1) for other in ("generate", "static"))
    return {"rates": out, "same_tokens": same, "rows": len(ids), "max_new": max_new}


def describe(r: dict) -> list[str]:
    lines = [(f"decode: {r['rows']} rows, <= {r['max_new']} new tokens, left-padded, the same seeds on both sides; "
              f"sampled and greedy tokens identical on both sides: {r['same_tokens']}"),
             "| decoder | sampled tokens/s | greedy tokens/s |", "|---|---|---|"]
    for name, modes in r["rates"].items():
        cells = [f"{statistics.median(v):,.0f} (min {min(v):,.0f}, max {max(v):,.0f})" for v in modes.values()]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    med = {n: statistics.median(m["sampled"]) for n, m in r["rates"].items()}
    lines.append(f"RATIO decode_tokens_per_s loop/generate = {med['loop'] / med['generate']:.2f}")
    lines.append(f"RATIO decode_tokens_per_s static/loop = {med['static'] / med['loop']:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("rl_data")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    print("\n".join(describe(measure(a.model_dir, a.rl_data, a.prompts, a.group, a.max_new, a.reps, a.device))))


if __name__ == "__main__":
    main()
