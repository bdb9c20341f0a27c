"""Run every RL example config as a user would and print one table: algorithm, steps, wall
time, held-out greedy accuracy of the starting SFT model and of the trained one (Wilson 95%
intervals), both on the same eval prompts.

usage: python benchmarks/examples_table.py [--out runs/examples] [extra overrides ...]

Each example runs as ``exactrl rl --config examples/<file>.yaml output_dir=...`` in its own
process (the first one builds the built-in SFT starting point if the cache lacks it; that
build is not counted in any row's wall time). Extra overrides go to every run, e.g.
``distributed.backend=fsdp2 distributed.nproc_per_node=2``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def starting_accuracy(eval_size: int):
    """Greedy accuracy of the built-in SFT model on the examples' eval prompts."""
    from exactrl.algorithms.sft import resolve
    from exactrl.data.encode import encode_prompts
    from exactrl.data.jsonl import read_jsonl
    from exactrl.models.loading import load_causal_lm, load_tokenizer
    from exactrl.rewards import load_rewards
    from exactrl.rollout.hf import HFEngine
    from exactrl.run.evaluation import evaluate_accuracy

    path = resolve("builtin-sft", "model")
    tok = load_tokenizer(path)
    prompts = encode_prompts(read_jsonl(resolve("builtin", "eval"))[:eval_size], tok, 256)
    with load_rewards("exactrl.tasks.arithmetic:reward") as rewards:
        decode = HFEngine(load_causal_lm(path, trainable=False), tok, 500).generate
        return evaluate_accuracy(decode, prompts, rewards.eval, batch_size=500,
                                 max_new_tokens=48)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/examples")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    before = starting_accuracy(500)  # builds the SFT starting point first if needed
    print(f"starting point (built-in SFT model), greedy on 500 eval prompts: {before}", flush=True)
    rows = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if "algo:" not in path.read_text():
            continue
        out = Path(args.out) / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "rl", "--config", str(path), f"output_dir={out}",
                               *args.overrides],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            rows.append((path.name, "-", f"{wall:.0f} s", str(before), f"FAILED (exit {proc.returncode})"))
            print(proc.stderr[-2000:], file=sys.stderr)
            continue
        metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
        final = [m for m in metrics if "eval_accuracy" in m][-1]
        lo, hi = final["eval_ci95"]
        algo = yaml.safe_load((out / "config.yaml").read_text())["algo"]["name"]
        rows.append((f"{algo} ({path.name})", str(final["step"]), f"{wall:.0f} s", str(before),
                     f"{100 * final['eval_accuracy']:5.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"))
        print(" | ".join(rows[-1]), flush=True)
    print("\n| algorithm (example) | steps | wall | greedy before | greedy after |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
