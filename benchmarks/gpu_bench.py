"""exactrl against Hugging Face TRL on one GPU: SFT tokens/s, MFU, peak memory, a memory-vs-batch sweep, GRPO.

usage: python benchmarks/gpu_bench.py [--dry-run] [--budget-s S] [--batches 16,32,64] [--reps 2]
                                      [--trl-python PY] [--exactrl-set key=value ...] [--results-dir DIR]
(on a lent GPU machine: scripts/gpu_bench.sh; `--dry-run` runs every step at tiny sizes on the CPU.)

What is compared, the same on both sides (benchmarks/sft_workers.py and grpo_workers.py run each side):
* model: a random Llama, hidden 2048, 16 layers, 32 heads, 8 kv heads, MLP 8192, vocabulary 32,000,
  untied head (~1.1B parameters), saved in bf16 and loaded into fp32 master weights; its tokenizer is
  one word per id, so a row's length in tokens is what was drawn;
* rows, seeded: 64-192 prompt tokens + 256-768 completion tokens, loss on the completion;
* settings: bf16 autocast over the fp32 weights (exactrl model.dtype=bf16, TRL bf16=True), AdamW lr
  1e-5 constant, clip 1.0, micro-batch = batch (no accumulation), no gradient checkpointing;
* SFT: trained tokens/s over the steps after the third, each side counting its own tokens; each
  measured run its own process, the two systems alternating (who goes first alternates too);
* MFU: 6 N x tokens/s (N: the weights of every linear layer, the head included) over the bf16
  8192^3 matmul rate measured in the same run, after the runs (on the CPU: the fp32 GEMM peak of
  benchmarks/mfu.py on the model's shapes); peak memory: torch.cuda.max_memory_allocated (CPU: RSS);
* sweep: from the table's batches, the batch doubles until each side runs out of memory (an OOM is a
  result) or reaches --sweep-max; those runs take 2 steps (the second holds the Adam state too);
* GRPO: the same prompts (64-192 tokens), 8 prompts x 8 responses, 256 new tokens (a random model
  rarely stops early), exactrl's in-process decode loop against GRPOTrainer's `generate`, no vLLM;
  a warm-up step, then 2 timed steps.
--budget-s bounds the whole run: the first rep of every table row, then GRPO, the sweep and further
reps, each run only if the time its like took before still fits. Prints `RATIO ...` and `MFU ...`
lines and writes benchmarks/results/gpu-bench-<time>.md. The TRL side runs where --trl-python (or
this interpreter, or `make bench`'s .venv-bench) has trl; elsewhere it is reported as not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import BENCH_PY, HERE, ROOT, SYSTEMS, Report, markdown, table

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=32000)
SIZES = {
    "gpu": dict(model=LLAMA_1B, prompt=(64, 192), completion=(256, 768), batches="16,32,64", reps=2, steps=8, skip=3,
                sweep_max=1024, grpo=dict(prompts=8, group=8, max_new=256, steps=2), dtype="bf16", device="cuda",
                budget_s=360),
    "dry": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=192, vocab_size=512),
                prompt=(8, 16), completion=(16, 48), batches="2", reps=1, steps=3, skip=1, sweep_max=4,
                grpo=dict(prompts=2, group=2, max_new=8, steps=1), dtype="fp32", device="cpu", budget_s=120),
}
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
LR = 1e-5


def build(work: Path, size: dict) -> tuple[Path, int]:
    """A random Llama of ``size`` and a one-word-per-id tokenizer, saved to work/model; and its matmul weights N.
    Built on the CPU: this process keeps no CUDA context (and memory) while the measured runs share the GPU."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    m = size["model"]
    words = SPECIAL + [f"w{i}" for i in range(m["vocab_size"] - len(SPECIAL))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    longest = size["prompt"][1] + size["completion"][1] + 2
    cfg = LlamaConfig(**m, max_position_embeddings=longest, tie_word_embeddings=False, rms_norm_eps=1e-5,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    n = sum(x.weight.numel() for x in model.modules() if isinstance(x, torch.nn.Linear))
    # bf16 on disk halves the load; both sides load it into fp32 master weights
    model.to(torch.bfloat16 if size["dtype"] == "bf16" else torch.float32).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    return work / "model", n


def words(rng: random.Random, lo_hi: tuple[int, int], vocab: int) -> str:
    return " ".join(f"w{rng.randrange(vocab - len(SPECIAL))}" for _ in range(rng.randint(*lo_hi)))


def sft_rows(work: Path, size: dict, n: int) -> Path:
    """The first ``n`` SFT rows; row i is drawn from its own seed, so every file shares its first rows."""
    path = work / f"sft-{n}.jsonl"
    if not path.exists():
        v, rngs = size["model"]["vocab_size"], map(random.Random, range(n))
        path.write_text("".join(json.dumps({"prompt": words(r, size["prompt"], v),
                                            "completion": " " + words(r, size["completion"], v)}) + "\n"
                                for r in rngs))
    return path


def grpo_prompts(work: Path, size: dict, n: int) -> Path:
    path = work / "grpo.jsonl"
    rng, v = random.Random(10**6), size["model"]["vocab_size"]
    path.write_text("".join(json.dumps({"prompt": words(rng, size["prompt"], v), "answer": ""}) + "\n"
                            for _ in range(n)))
    return path


def trl_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter that runs TRL's side, and what to say of it: --trl-python, else this one or .venv-bench's."""
    tries = [given] if given else [sys.executable, str(BENCH_PY)]
    for py in tries:
        probe = subprocess.run([py, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True) \
            if Path(py).exists() else None
        if probe is not None and probe.returncode == 0:
            return py, f"TRL {probe.stdout.strip()} ({py})"
    if given:
        raise SystemExit(f"--trl-python {given}: cannot import trl there (make .venv-bench/.installed builds one)")
    return None, f"TRL not installed (none of {', '.join(tries)} imports trl; `make bench` builds .venv-bench)"


class Runs:
    """Launches measured runs one at a time, each its own process, within a time budget."""

    def __init__(self, budget_s: float, threads: int, pythons: dict, work: Path, say: Report, why_not: str):
        self.end, self.threads, self.pythons, self.say = time.monotonic() + budget_s, threads, pythons, say
        self.work, self.why_not = work, why_not  # why_not: what a side without an interpreter says
        self.first_guess = budget_s / 10  # a run of a kind not run before: a tenth of the budget
        self.took: dict[tuple, float] = {}
        self.rows: list[dict] = []

    def left(self) -> float:
        return self.end - time.monotonic()

    def launch(self, kind: str, system: str, batch: int, rep: int, args: list, opts: dict, like: tuple = ()) -> dict:
        """One run of worker ``kind``_workers.py with ``args`` (then threads and its output directory, which goes
        when it ends: exactrl saves the model); dropped when what it took last time (else its like: ``like``, or
        the last run of its kind and side, else first_guess) does not fit in the budget left. Returns its row."""
        key = (kind, system, batch)
        row = dict(kind=kind, system=system, batch=batch, rep=rep)
        if self.pythons[system] is None:
            self.rows.append(row := {**row, "skipped": self.why_not})
            return row
        guess = self.took.get(key, self.took.get(like or (kind, system), self.first_guess))
        if guess > self.left():
            self.rows.append(row := {**row, "skipped": f"budget ({guess:.0f} s needed, {self.left():.0f} s left)"})
            self.say(f"{kind} {system} batch {batch} rep {rep}: dropped, {row['skipped']}")
            return row
        t0 = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        out = self.work / f"{kind}-{system}-{batch}-{rep}"
        cmd = [self.pythons[system], str(HERE / f"{kind}_workers.py"), system, *map(str, args), str(self.threads),
               str(out), json.dumps(opts)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                                  timeout=max(60.0, self.left() + 60))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            result = json.loads(lines[-1][len("RESULT "):]) if proc.returncode == 0 and lines else \
                {"failed": f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])[-600:]}
        except subprocess.TimeoutExpired:
            result = {"failed": "timed out"}
        shutil.rmtree(out, ignore_errors=True)
        self.took[key] = self.took[(kind, system)] = time.monotonic() - t0
        self.rows.append(row := {**row, **result, "wall_s": self.took[key]})
        self.say(f"{kind} {system} batch {batch} rep {rep}: {describe(row)} ({row['wall_s']:.0f} s)")
        return row


def describe(r: dict) -> str:
    if "skipped" in r or "failed" in r:
        return r.get("skipped") or f"FAILED {r['failed']}"
    memory = f"peak memory {r['peak_memory_mb'] / 1024:.1f} GB"
    if r.get("oom"):
        return f"out of memory ({memory} before it)"
    if "steps_per_s" in r:
        return f"{r['steps_per_s']:.3f} steps/s, {r['gen_tokens_per_s']:,.0f} generated tokens/s, {memory}"
    return f"{r['tokens_per_s']:,.0f} tokens/s over {r['timed_steps']} steps, {memory}"


def measured(rows: list[dict], kind: str, system: str, batch: int | None = None) -> list[dict]:
    """The runs of ``kind`` by ``system`` (at ``batch``) that gave figures."""
    return [r for r in rows if r["kind"] == kind and r["system"] == system and (batch is None or r["batch"] == batch)
            and not {"skipped", "failed", "oom"} & set(r)]


def status(rows: list[dict], kind: str, system: str, batch: int) -> str | None:
    """Why a side has no figure for this row: out of memory, not installed, dropped, failed."""
    mine = [r for r in rows if (r["kind"], r["system"], r["batch"]) == (kind, system, batch)]
    for what in ("oom", "failed", "skipped"):
        if hit := [r for r in mine if what in r]:
            return "out of memory" if what == "oom" else (hit[0][what] if what == "skipped" else "failed")
    return None if mine else "not run"


def sft_table(say: Report, runs: Runs, batches: list[int], n: int, peak: float, unit: str) -> None:
    rows, tps, mem = [], {}, {}
    for b in batches:
        cells = {}
        for s in SYSTEMS:
            got = measured(runs.rows, "sft", s, b)
            tps[s, b] = statistics.median(r["tokens_per_s"] for r in got) if got else None
            mem[s, b] = max((r["peak_memory_mb"] for r in runs.rows if (r["kind"], r["system"], r["batch"]) ==
                             ("sft", s, b) and "peak_memory_mb" in r), default=None)
            cells[s] = ", ".join(f"{r['tokens_per_s'] / 1e3:.1f}k" for r in got) or status(runs.rows, "sft", s, b)
        ex = measured(runs.rows, "sft", "exactrl", b)
        per_step = f"~{statistics.mean(r['all_tokens'] / r['steps'] for r in ex) / 1e3:.1f}k" if ex else "?"
        ratio = tps["exactrl", b] / tps["trl", b] if tps["exactrl", b] and tps["trl", b] else None
        mfu = {s: f"{100 * 6 * n * tps[s, b] / peak:.1f}%" if tps[s, b] else "—" for s in SYSTEMS}
        gb = {s: "OOM" if status(runs.rows, "sft", s, b) == "out of memory" else
              f"{mem[s, b] / 1024:.1f} GB" if mem[s, b] is not None else "—" for s in SYSTEMS}
        rows.append([f"{b} ({per_step})", cells["exactrl"], cells["trl"], f"{ratio:.2f}" if ratio else "—",
                     f"{mfu['exactrl']} / {mfu['trl']}", f"{gb['exactrl']} / {gb['trl']}"])
        say(f"RATIO sft_tokens_per_s exactrl/trl batch {b} = " + (f"{ratio:.2f}" if ratio else
                                                                  f"n/a ({status(runs.rows, 'sft', 'trl', b)})"))
        if tps["exactrl", b]:
            say(f"MFU sft exactrl batch {b} = {100 * 6 * n * tps['exactrl', b] / peak:.1f}% of measured {unit}")
    say("", "SFT (exactrl's tokens/step in the first column)",
        *table(["batch (tokens/step)", "exactrl tokens/s (runs)", "TRL tokens/s (runs)", "ratio",
                "MFU exactrl / TRL (6N)", "peak memory exactrl / TRL"], rows))
    best = {s: max((v for (x, _), v in tps.items() if x == s and v), default=None) for s in SYSTEMS}
    if best["exactrl"] and best["trl"]:
        say(f"RATIO sft_tokens_per_s exactrl/trl best batch each = {best['exactrl'] / best['trl']:.2f}")


def sweep(runs: Runs, work: Path, model: Path, size: dict, batches: list[int], opts: dict, cap: int) -> None:
    """Each side doubles the batch past the table's until it runs out of memory or reaches ``cap``."""
    for s in SYSTEMS:
        b = max(batches)
        while b < cap and status(runs.rows, "sft", s, b) is None:
            b *= 2
            runs.launch("sft", s, b, 0, [model, sft_rows(work, size, 2 * b), b], {**opts[s], "skip_steps": 1},
                        like=("sft", s, b // 2))


def sweep_table(say: Report, runs: Runs) -> None:
    batches = sorted({r["batch"] for r in runs.rows if r["kind"] == "sft"})
    cell = {}
    for s in SYSTEMS:
        for b in batches:
            mine = [r for r in runs.rows if (r["kind"], r["system"], r["batch"]) == ("sft", s, b)]
            peaks = [r["peak_memory_mb"] for r in mine if "peak_memory_mb" in r and not r.get("oom")]
            cell[s, b] = f"{max(peaks) / 1024:.1f} GB" if peaks else (status(runs.rows, "sft", s, b) or "—")
        fits = [b for b in batches if cell[s, b].endswith("GB")]
        say(f"SWEEP {s}: largest batch that fit = {max(fits) if fits else 'none'}; "
            + ", ".join(f"{b}: {cell[s, b]}" for b in batches))
    say("", "Peak memory against batch (the sweep; the table's runs included)",
        *table(["batch", "exactrl", "TRL"], [[str(b), cell["exactrl", b], cell["trl", b]] for b in batches]))


def grpo_table(say: Report, runs: Runs, g: dict) -> None:
    got = {s: measured(runs.rows, "grpo", s) for s in SYSTEMS}
    rows = [[s, ", ".join(f"{r['steps_per_s']:.3f}" for r in got[s]) or status(runs.rows, "grpo", s, 0),
             ", ".join(f"{r['gen_tokens_per_s']:,.0f}" for r in got[s]) or "—",
             ", ".join(f"{r['mean_completion_len']:.0f}" for r in got[s]) or "—",
             ", ".join(f"{r['peak_memory_mb'] / 1024:.1f} GB" for r in got[s]) or "—"] for s in SYSTEMS]
    say("", f"GRPO ({g['prompts']} prompts x {g['group']} responses, <= {g['max_new']} new tokens, "
            f"{g['steps']} steps timed after a warm-up; generation included)",
        *table(["system", "steps/s", "generated tokens/s", "mean completion length", "peak memory"], rows))
    sps = {s: statistics.median(r["steps_per_s"] for r in got[s]) if got[s] else None for s in SYSTEMS}
    say("RATIO grpo_steps_per_s exactrl/trl = " + (f"{sps['exactrl'] / sps['trl']:.2f}" if sps["exactrl"] and sps[
        "trl"] else f"n/a ({status(runs.rows, 'grpo', 'trl', 0)})"))


def matmul_peak(device: str, size: dict, threads: int) -> tuple[float, str]:
    """FLOP/s of the matmul peak this machine gives, measured now, and how it is named."""
    import torch
    from mfu import cuda_matmul_flops, gemm_gflops

    if device == "cuda":
        flops = cuda_matmul_flops(8192, torch.bfloat16)
        return flops, f"bf16 8192^3 matmul peak {flops / 1e12:.0f} TFLOP/s"
    torch.set_num_threads(threads)
    m = size["model"]
    flops = max(gemm_gflops(1024, m["hidden_size"], n, trials=3, min_seconds=0.05)
                for n in (m["hidden_size"], m["intermediate_size"])) * 1e9
    return flops, f"fp32 GEMM peak {flops / 1e9:.1f} GFLOP/s"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (what CI runs)")
    ap.add_argument("--budget-s", type=float, help="seconds for the whole run (default 360; dry run 120)")
    ap.add_argument("--batches", help="the table's batches, comma-separated (default 16,32,64; dry run 2)")
    ap.add_argument("--reps", type=int, help="measured runs per side per batch (default 2; dry run 1)")
    ap.add_argument("--sweep-max", type=int, help="the sweep's largest batch (default 1024; dry run 4)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--trl-python", help="interpreter with trl (default: this one, else .venv-bench's)")
    ap.add_argument("--no-trl", action="store_true", help="run exactrl's side only (its TRL cells say so)")
    ap.add_argument("--exactrl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an exactrl config override for exactrl's side only (repeatable), e.g. a new speed option")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if bad := [o for o in args.exactrl_set if "=" not in o or o.startswith("=")]:
        ap.error(f"--exactrl-set {bad[0]!r}: write key=value, e.g. train.gradient_checkpointing=true")
    return args


def main() -> int:
    args = parse_args()
    size = SIZES["dry" if args.dry_run else "gpu"]
    batches = [int(b) for b in (args.batches or size["batches"]).split(",")]
    reps, budget = args.reps or size["reps"], args.budget_s or size["budget_s"]
    g, device, say = size["grpo"], size["device"], Report()
    if device == "cuda":
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True)
        if probe.stdout.strip() != "True":
            print("gpu_bench: this torch sees no CUDA device; run it on a GPU, or --dry-run on the CPU")
            return 2
    trl, trl_note = (None, "TRL not run (--no-trl)") if args.no_trl else trl_python(args.trl_python)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="exactrl-gpu-bench-") as tmp:
        work = Path(tmp)
        model, n = build(work, size)
        say(f"{'DRY RUN (CPU, tiny sizes): ' if args.dry_run else ''}model {json.dumps(size['model'])}, untied head, "
            f"N = {n:,} matmul weights; rows {size['prompt']} prompt + {size['completion']} completion tokens; "
            f"{size['dtype']} on {device}; AdamW lr {LR} constant, clip 1.0, no accumulation, no checkpointing; "
            f"{size['steps']} steps a run, tokens/s over those after step {size['skip']}; budget {budget:.0f} s",
            f"exactrl overrides: {' '.join(args.exactrl_set) or '(none)'}; {trl_note}")
        runs = Runs(budget - (time.monotonic() - t_start), args.threads, {"exactrl": sys.executable, "trl": trl},
                    work, say, "not run (--no-trl)" if args.no_trl else "not installed")
        base = dict(dtype=size["dtype"], device=device, lr=LR, max_length=size["prompt"][1] + size["completion"][1] + 2)
        opts = {"exactrl": {**base, "exactrl_set": args.exactrl_set}, "trl": base}

        def sft(system: str, batch: int, rep: int) -> None:
            data = sft_rows(work, size, batch * size["steps"])
            runs.launch("sft", system, batch, rep, [model, data, batch], {**opts[system], "skip_steps": size["skip"]})

        # the first rep of every row, then GRPO, the sweep and the other reps, as long as the budget lasts
        for i, b in enumerate(batches):
            for s in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
                sft(s, b, 0)
        prompts = grpo_prompts(work, size, g["prompts"] * (g["steps"] + 1))
        for s in SYSTEMS:
            runs.launch("grpo", s, 0, 0, [model, prompts, g["prompts"], g["group"], g["max_new"], g["steps"]],
                        {**opts[s], "reward": "text"})
        sweep(runs, work, model, size, batches, opts, args.sweep_max or size["sweep_max"])
        for rep in range(1, reps):
            for i, b in enumerate(batches):
                for s in SYSTEMS if (i + rep) % 2 == 0 else SYSTEMS[::-1]:
                    sft(s, b, rep)
        peak, unit = matmul_peak(device, size, args.threads)
    sft_table(say, runs, batches, n, peak, unit)
    sweep_table(say, runs)
    grpo_table(say, runs, g)
    versions = {r["system"]: r["versions"] for r in runs.rows if "versions" in r}
    failed = [r for r in runs.rows if "failed" in r]
    say("", f"wall {time.monotonic() - t_start:.0f} s; {len(failed)} failed run(s); versions {json.dumps(versions)}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"gpu-bench-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.write_text(f"# exactrl vs TRL on {device}{' (dry run)' if args.dry_run else ''}\n\n" + markdown(say.lines) +
                   "\n## Every run\n\n```\n" + "\n".join(json.dumps(r) for r in runs.rows) + "\n```\n")
    print(f"results: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
