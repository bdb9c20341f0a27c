"""exactrl and Hugging Face TRL side by side on the same model, data and settings (issue 7).

usage: .venv/bin/python benchmarks/bench.py [--config {bench,quick}] [--reps N] [--threads T]
                                            [--only sft,grpo,mfu,canary,decode,audit]
(`make bench` sets up TRL in .venv-bench, so its pins never touch exactrl's, and runs this.)

What is compared, so anyone can rerun it:
* model: a Llama-architecture causal LM built locally from the built-in task's character
  tokenizer -- ``bench``: hidden 512, 8 layers, 8 heads, MLP 1408 (~26M parameters);
  ``quick``: the built-in tiny model (hidden 128, 4 layers, ~0.9M); random initialisation;
* settings, the same on both sides: fp32 (no autocast), no gradient checkpointing (TRL's CPU
  defaults turn both bf16 and checkpointing on, see ../shared/FACTS.md), AdamW, clip 1.0,
  micro-batch = batch (no accumulation), torch threads = --threads;
* sft: the first rows of the built-in SFT data (prompt/completion, loss on the completion),
  one epoch, lr 1e-4 constant (benchmarks/sft_workers.py);
* grpo: the built-in task's RL prompts and verifier reward, prompts x group responses per
  optimizer step sampled from the model being trained, max_new tokens, temperature 1, KL 0,
  one update per rollout, lr 1e-6 constant; a warm-up step, then ``steps`` timed steps,
  generation included (benchmarks/grpo_workers.py has every setting);
* each measured run is its own process; the two systems alternate rep by rep; medians and
  min-max spread are reported;
* mfu: SFT model FLOPs per second over the fp32 GEMM peak measured here (benchmarks/mfu.py);
* canary: exactrl's single engine, SFT steps with the canary on vs off, paired
  (benchmarks/canary_overhead.py); decode: exactrl's decode loop against Hugging Face's
  ``generate``, the same model, prompts and draws (benchmarks/decode_speed.py); audit: the wall
  time of `exactrl audit stack`.
Prints ``RATIO sft_tokens_per_s exactrl/trl``, ``RATIO grpo_steps_per_s exactrl/trl`` and
``RATIO peak_rss trl/exactrl`` (higher is better for exactrl; RSS: each system's larger median
peak RSS of its SFT and GRPO runs), ``MFU sft ...``, ``canary overhead ...``,
``RATIO decode_tokens_per_s loop/generate`` and ``audit stack wall = X s``, and writes everything
to a markdown file under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
PARTS = ("sft", "grpo", "mfu", "canary", "decode", "audit")
CONFIGS = {
    "bench": dict(model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                             intermediate_size=1408), rows=512, batch=16,
                  grpo=dict(prompts=16, group=8, max_new=48, steps=10), canary_pairs=30),
    "quick": dict(model={}, rows=2000, batch=32, grpo=dict(prompts=8, group=8, max_new=48, steps=20), canary_pairs=30),
}
RL_ROWS = 1000  # the RL prompts both sides draw from (each in its own shuffled order)
SYSTEMS = ("exactrl", "trl")


def prepare(name: str, work: Path) -> tuple[Path, Path, Path, int]:
    """The model directory, SFT data and RL prompts of configuration ``name``, and the parameter count."""
    from exactrl.tasks.builtin import ensure_builtin
    from exactrl.tasks.tiny_model import build_tiny_model
    from exactrl.tasks.tokenizer import save_tokenizer

    cfg, paths = CONFIGS[name], ensure_builtin()
    model_dir = work / f"model-{name}"
    tok = save_tokenizer(model_dir)
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0, **cfg["model"])
    model.save_pretrained(model_dir)
    sft, rl = work / f"sft-{name}.jsonl", work / f"rl-{name}.jsonl"
    sft.write_text("\n".join(paths.sft_train.read_text().splitlines()[: cfg["rows"]]) + "\n")
    rl.write_text("\n".join(paths.rl_train.read_text().splitlines()[:RL_ROWS]) + "\n")
    return model_dir, sft, rl, sum(p.numel() for p in model.parameters())


def run_worker(script: str, system: str, args: list, threads: int) -> dict:
    python = sys.executable if system == "exactrl" else str(BENCH_PY)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, str(HERE / script), system, *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{script} {system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def interleaved(reps: int, launch, describe) -> dict[str, list[dict]]:
    """``launch(system, rep)`` for every rep, exactrl first on even reps and TRL first on odd ones."""
    results: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for rep in range(reps):
        for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
            results[system].append(r := launch(system, rep))
            print(f"rep {rep} {system:8s} {describe(r)}  peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
    return results


def spread(values: list[float], fmt: str = ",.0f") -> str:
    return f"{statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def median_of(results: dict[str, list[dict]], key: str) -> dict[str, float]:
    return {s: statistics.median(r[key] for r in rs) for s, rs in results.items()}


class Report:
    """Lines printed as they come and kept for the results file."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *lines: str) -> None:
        print("\n".join(lines), flush=True)
        self.lines += lines


def sft_part(say: Report, results: dict[str, list[dict]]) -> None:
    rows = [[s, spread([r["tokens_per_s"] for r in rs]), spread([r["peak_rss_mb"] for r in rs]), str(rs[0]["tokens"]),
             str(rs[0]["steps"])] for s, rs in results.items()]
    say("", "SFT (medians over reps, with min and max)",
        *table(["system", "trained tokens/s", "peak RSS MB", "trained tokens", "optimizer steps"], rows))
    tps = median_of(results, "tokens_per_s")
    say(f"RATIO sft_tokens_per_s exactrl/trl = {tps['exactrl'] / tps['trl']:.2f}")


def grpo_part(say: Report, results: dict[str, list[dict]], g: dict) -> None:
    rows = []
    for s, rs in results.items():
        first = rs[0]
        checks = (f"{first['optimizer_steps']} optimizer steps ({first['timed_steps']} timed), completions/step "
                  f"{first['completions_per_step']}, prompts/step {first['prompts_per_step']}, responses/prompt "
                  f"{first['responses_per_prompt']}")
        column = lambda key, fmt=",.0f", rs=rs: spread([r[key] for r in rs], fmt)  # noqa: E731
        rows.append([s, column("steps_per_s", ".3f"), column("gen_tokens_per_s"), column("mean_completion_len", ".1f"),
                     column("reward_mean", ".3f"), column("peak_rss_mb"), checks])
    say("", f"GRPO ({g['prompts']} prompts x {g['group']} responses per step, <= {g['max_new']} new tokens, "
            f"{g['steps']} timed steps after 1 warm-up; responses sampled from the same initial model on both sides; "
            "medians over reps, with min and max)",
        *table(["system", "optimizer steps/s", "generated tokens per s of step time", "mean completion length",
                "mean reward", "peak RSS MB",
                "checked (rep 0)"], rows))
    for s, rs in results.items():
        expected = (g["steps"] + 1, [g["prompts"] * g["group"]], [g["prompts"]], [g["group"]])
        for r in rs:
            got = (r["optimizer_steps"], r["completions_per_step"], r["prompts_per_step"], r["responses_per_prompt"])
            if got != expected:
                raise SystemExit(f"GRPO {s}: (optimizer steps, completions/step, prompts/step, responses/prompt) = "
                                 f"{got}, expected {expected}")
    sps = median_of(results, "steps_per_s")
    say(f"RATIO grpo_steps_per_s exactrl/trl = {sps['exactrl'] / sps['trl']:.2f}")


def mfu_part(say: Report, sft: dict[str, list[dict]], model_dir: Path, data: Path, batch: int, threads: int) -> None:
    import torch
    from mfu import gemm_peak, sft_flops

    torch.set_num_threads(threads)
    f = sft_flops(str(model_dir), str(data))
    peaks = gemm_peak(round(batch * f.seq_mean), f.hidden, f.intermediate)
    peak = max(peaks.values())
    say("",
        "MFU: model FLOPs per trained token = 6 N + 12 L d T = "
        f"6 x {f.matmul_params:,} + 12 x {f.layers} x "
        f"{f.hidden} x {f.seq_eff:.1f} = "
        f"{f.per_token / 1e6:.1f} MFLOP (N: every nn.Linear "
        "incl. lm_head; T = sum T_i^2 / sum T_i); fp32 "
        "torch.mm GFLOP/s, best of 7: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()))
    for s, tps in median_of(sft, "tokens_per_s").items():
        say(f"MFU sft {s} = {100 * tps * f.per_token / (peak * 1e9):.1f}% of measured GEMM peak {peak:.0f} GFLOP/s")


def canary_part(say: Report, config: str, model_dir: Path, data: Path, batch: int, pairs: int) -> None:
    from canary_overhead import measure

    from exactrl.data.encode import encode_sft
    from exactrl.data.jsonl import read_jsonl
    from exactrl.models.loading import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    micro = max(1, batch // 4)
    r = measure("single", model_dir, encode_sft(read_jsonl(str(data)), tok, 256), tok, pairs, 3, batch, micro)
    q = r["quartiles"]
    say("", f"canary: median SFT step on {r['on_ms']:.1f} ms, off {r['off_ms']:.1f} ms; paired on/off ratio quartiles "
            f"{q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} ({pairs} pairs, batch {batch} = {batch // micro} micro-batches of "
            f"{micro})",
        f"canary overhead (single engine, {config} model) = {100 * (q[1] - 1):.1f}%")


def decode_part(say: Report, model_dir: Path, rl_data: Path, g: dict, reps: int) -> None:
    from decode_speed import describe, measure

    say("", *describe(measure(model_dir, rl_data, g["prompts"], g["group"], g["max_new"], reps)))


def audit_part(say: Report) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).with_name("exactrl")), "audit", "stack"], capture_output=True,
                          text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or proc.stderr.splitlines()[-1:]
    say("", f"`exactrl audit stack`: exit {proc.returncode}; last line: {tail[0].strip() if tail else '(none)'}",
        f"audit stack wall = {wall:.0f} s (goal <= 180 s)")


def markdown(lines: list[str]) -> str:
    """Table rows stay together; every other line is a paragraph of its own."""
    text = ""
    for i, line in enumerate(lines):
        if line.startswith("|") and i > 0 and lines[i - 1].startswith("|"):
            text += line + "\n"
        elif line:
            text += "\n" + line + "\n"
    return text.lstrip("\n")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {','.join(PARTS)} (mfu needs sft)")
    args = ap.parse_args()
    parts = args.only.split(",")
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--only: unknown part(s) {sorted(unknown)}; choose from {','.join(PARTS)}")
    if "mfu" in parts and "sft" not in parts:
        raise SystemExit("--only: mfu divides SFT's measured tokens/s by the GEMM peak, so it needs sft too")
    if {"sft", "grpo"} & set(parts) and not BENCH_PY.exists():
        raise SystemExit(f"{BENCH_PY} is missing: run `make bench` (it installs TRL there)")
    return args, parts


def peak_rss_part(say: Report, sft: dict | None, grpo: dict | None) -> None:
    """Each system's larger median peak RSS over its SFT and GRPO runs, TRL's over exactrl's."""
    measured = [(name, res) for name, res in (("SFT", sft), ("GRPO", grpo)) if res]
    rss = {s: max(median_of(res, "peak_rss_mb")[s] for _, res in measured) for s in SYSTEMS}
    say(f"RATIO peak_rss trl/exactrl = {rss['trl'] / rss['exactrl']:.2f}  (each system's larger median peak RSS of "
        f"its {' and '.join(name for name, _ in measured)} runs: exactrl {rss['exactrl']:,.0f} MB, trl "
        f"{rss['trl']:,.0f} MB)")


def main() -> None:
    args, parts = parse_args()
    cfg, g, t = CONFIGS[args.config], CONFIGS[args.config]["grpo"], args.threads
    say = Report()
    sft = grpo = None
    with tempfile.TemporaryDirectory(prefix="exactrl-bench-") as tmp:
        work = Path(tmp)
        model_dir, sft_data, rl_data, params = prepare(args.config, work)
        say(f"config {args.config}: {params / 1e6:.1f}M parameters, random init; fp32, no gradient checkpointing, {t} "
            f"threads, {args.reps} reps interleaved; SFT: {cfg['rows']} rows, batch {cfg['batch']}, one epoch, lr "
            f"1e-4; GRPO: {g['prompts']} prompts x {g['group']}, <= {g['max_new']} new tokens, temperature 1, 1 + "
            f"{g['steps']} steps, lr 1e-6; parts {','.join(parts)}; 1-min load average at start "
            f"{os.getloadavg()[0]:.1f} (other processes skew every figure)")
        if "sft" in parts:
            sft = interleaved(args.reps, lambda s, rep: run_worker("sft_workers.py", s, [model_dir, sft_data, cfg[
                "batch"], t,
                                                                                      work / f"sft-{s}-{rep}"], t),
                              lambda r: f"SFT {r['tokens_per_s']:9,.0f} tok/s  {r['seconds']:6.1f} s")
        if "grpo" in parts:
            grpo = interleaved(args.reps, lambda s, rep: run_worker("grpo_workers.py", s, [model_dir, rl_data, g[
                "prompts"], g["group"],
                                                                                        g["max_new"], g["steps"], t,
                                                                                        work / f"grpo-{s}-{rep}"], t),
                               lambda r: f"GRPO {r['steps_per_s']:.3f} steps/s  {r['gen_tokens_per_s']:7,.0f} gen "
                                         f"tok/s  mean len {r['mean_completion_len']:.1f}")
        if sft:
            sft_part(say, sft)
        if grpo:
            grpo_part(say, grpo, g)
        if sft or grpo:
            peak_rss_part(say, sft, grpo)
        if "mfu" in parts:
            mfu_part(say, sft, model_dir, sft_data, cfg["batch"], t)
        if "canary" in parts:
            canary_part(say, args.config, model_dir, sft_data, cfg["batch"], cfg["canary_pairs"])
        if "decode" in parts:
            decode_part(say, model_dir, rl_data, g, args.reps)
    if "audit" in parts:
        audit_part(say)
    say("", f"1-min load average at the end {os.getloadavg()[0]:.1f}")
    versions = {s: rs[0]["versions"] for s, rs in (sft or grpo or {}).items()}
    out = ROOT / "benchmarks" / "results" / f"{args.config}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = say.lines + ([f"Versions: {json.dumps(versions)}"] if versions else [])
    out.write_text(f"# exactrl vs TRL, config {args.config}\n\n" + markdown(body))
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
