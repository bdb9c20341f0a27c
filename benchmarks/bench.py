"""exactrl and Hugging Face TRL side by side on the same model, data and settings (issue 7's
harness; this first step measures SFT only).

usage: .venv/bin/python benchmarks/bench.py [--config {bench,quick}] [--reps N] [--threads T]
(`make bench` sets up TRL in .venv-bench, so its pins never touch exactrl's, and runs this.)

What is compared, so anyone can rerun it:
* model: a Llama-architecture causal LM built locally from the built-in task's character
  tokenizer -- ``bench``: hidden 512, 8 layers, 8 heads, MLP 1408 (~25M parameters);
  ``quick``: the built-in tiny model (hidden 128, 4 layers, ~1.2M);
* data: the first rows of the built-in task's SFT data (prompt/completion, loss on the
  completion), sequences well under 256 tokens;
* settings, the same on both sides: fp32 (no autocast), no gradient checkpointing (TRL's CPU
  defaults turn both bf16 and checkpointing on, see ../shared/FACTS.md), AdamW lr 1e-4
  constant, clip 1.0, micro-batch = batch, one epoch, torch threads = --threads;
* each measured run is its own process (benchmarks/sft_workers.py); the two systems alternate
  rep by rep; medians and min-max spread are reported.
Prints ``RATIO sft_tokens_per_s exactrl/trl = X.XX`` and ``RATIO peak_rss trl/exactrl = X.XX``
(higher is better for exactrl) and writes a markdown table under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("sft_workers.py")
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
CONFIGS = {
    "bench": dict(model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                             intermediate_size=1408), rows=512, batch=16),
    "quick": dict(model={}, rows=2000, batch=32),
}


def prepare(name: str, work: Path) -> tuple[Path, Path, int]:
    """The model directory and data file of configuration ``name``; returns them and the parameter count."""
    from exactrl.tasks.builtin import ensure_builtin
    from exactrl.tasks.tiny_model import build_tiny_model
    from exactrl.tasks.tokenizer import save_tokenizer

    cfg = CONFIGS[name]
    model_dir = work / f"model-{name}"
    tok = save_tokenizer(model_dir)
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0, **cfg["model"])
    model.save_pretrained(model_dir)
    rows = (ensure_builtin().sft_train).read_text().splitlines()[: cfg["rows"]]
    data = work / f"sft-{name}.jsonl"
    data.write_text("\n".join(rows) + "\n")
    return model_dir, data, sum(p.numel() for p in model.parameters())


def run(system: str, model_dir: Path, data: Path, batch: int, threads: int, out: Path) -> dict:
    python = sys.executable if system == "exactrl" else str(BENCH_PY)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, str(WORKER), system, str(model_dir), str(data), str(batch), str(threads), str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{system} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} (min {min(values):,.0f}, max {max(values):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if not BENCH_PY.exists():
        raise SystemExit(f"{BENCH_PY} is missing: run `make bench` (it installs TRL there)")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="exactrl-bench-") as tmp:
        work = Path(tmp)
        model_dir, data, params = prepare(args.config, work)
        batch = CONFIGS[args.config]["batch"]
        print(f"config {args.config}: {params / 1e6:.1f}M parameters, {CONFIGS[args.config]['rows']} rows, batch {batch}, "
              f"fp32, no gradient checkpointing, {args.threads} threads, {args.reps} reps interleaved", flush=True)
        results: dict[str, list[dict]] = {"exactrl": [], "trl": []}
        for rep in range(args.reps):
            for system in (("exactrl", "trl") if rep % 2 == 0 else ("trl", "exactrl")):
                r = run(system, model_dir, data, batch, args.threads, work / f"out-{system}-{rep}")
                results[system].append(r)
                print(f"rep {rep} {system:8s} {r['tokens_per_s']:9,.0f} tok/s  {r['seconds']:6.1f} s  peak RSS {r['peak_rss_mb']:,.0f} MB",
                      flush=True)
    tps = {s: [r["tokens_per_s"] for r in rs] for s, rs in results.items()}
    rss = {s: [r["peak_rss_mb"] for r in rs] for s, rs in results.items()}
    lines = ["| system | SFT trained tokens/s, median (min, max) | peak RSS MB, median (min, max) |", "|---|---|---|"]
    lines += [f"| {s} | {summary(tps[s])} | {summary(rss[s])} |" for s in ("exactrl", "trl")]
    print("\n" + "\n".join(lines))
    print(f"RATIO sft_tokens_per_s exactrl/trl = {statistics.median(tps['exactrl']) / statistics.median(tps['trl']):.2f}")
    print(f"RATIO peak_rss trl/exactrl = {statistics.median(rss['trl']) / statistics.median(rss['exactrl']):.2f}")
    out = ROOT / "benchmarks" / "results" / f"sft-{args.config}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# SFT, config {args.config}\n\n{params / 1e6:.1f}M parameters, batch {batch}, {args.threads} threads, "
                   f"{args.reps} reps\n\n" + "\n".join(lines) + "\n")
    print(f"table: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
