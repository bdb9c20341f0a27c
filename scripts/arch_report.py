"""The architecture table: for every tiny model of tests/archs.py, what a run of exactrl does
with it, measured through the path a run takes.

usage: python scripts/arch_report.py [NAME ...] [--no-cli] [--out FILE]

Columns: the self-checks' decisions (determinism, packing) and the path training takes; the training
forward's log-prob and gradient errors against Hugging Face's eager forward of each sequence
alone (fp32, relative as in tests/test_arch_matrix.py); the generation self-check's decoder and
its sampled log-prob error; whether exactrl's greedy decoding of a left-padded batch picks the
tokens ``generate`` picks for each prompt alone; and whether ``exactrl sft`` / ``exactrl rl`` run two steps
through the command line. Each architecture runs in a process of its own (a crash or a hang
is a row, not the end of the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def measure(name: str, tmp: Path) -> dict:
    """In this process: self-check, training-forward errors, decoding vs generate."""
    import random

    import torch

    from archs import VOCAB, build, save
    from exactrl.checks.packing import check_packing
    from exactrl.losses.token_losses import token_logprobs
    from exactrl.models import dsa, packing
    from exactrl.models.loading import load_causal_lm
    from exactrl.rollout.hf import sample
    from test_arch_matrix import CORRECTED, LENGTHS

    row: dict = {"name": name}
    rng = random.Random(0)
    seqs = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]
    try:
        save(name, tmp / name)
        model = load_causal_lm(tmp / name)
    except Exception as e:
        return row | {"check": f"load fails: {one_line(e)}"}
    train_mode, random = None, ""
    try:  # the determinism self-check, where this version of exactrl has it
        from exactrl.checks.determinism import check_determinism

        det = check_determinism(model, VOCAB, [13, 24, 3])
        if not det.deterministic:
            train_mode, random = False, f"random step ({det.source.split(' ')[0]}): rl refused; "
    except ImportError:
        pass
    try:
        kw = {} if train_mode is None else {"train_mode": train_mode}
        report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4, **kw)
        why = (report.notice or "").split(": ")[-1].split(";")[0][:90]
        row["check"] = random + ("packed" if report.packed else f"padded ({why})")
        own = getattr(report, "attention", "exactrl")
        row["path"] = (f"packed, {report.kernel}" if report.packed else "padded"
                       + ("" if own == "exactrl" else f", {own} attention"))
    except Exception as e:
        row["check"] = f"raises {one_line(e)}"
        row["path"] = "-"
    if train_mode is False:
        model.eval()
    try:
        ref = build(name)
        ref.set_attn_implementation("eager")
        dsa.break_ties_by_position(ref)  # tied sparse-attention keys: the earliest, as exactrl keeps them
        ref.eval()
        weights = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
        ref_rows = []
        for s in seqs:
            ids = torch.tensor([s])
            ref_rows.append(ref(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[
                :, 0])
        sum((r * w).sum() for r, w in zip(ref_rows, weights)).backward()
        mb = packing.model_batch(model, seqs, 0, packed=True)
        lp = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
        rows = [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]
        sum((r * w).sum() for r, w in zip(rows, weights)).backward()
        scale = max(1.0, max(r.abs().max().item() for r in ref_rows))
        row["logprob_err"] = max((a - b).abs().max().item() for a, b in zip(rows, ref_rows)) / scale
        grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        total = torch.cat([g.flatten() for g in grads.values()]).norm().item()
        err = 0.0
        for n, p in model.named_parameters():
            if n in grads and p.grad is not None:
                err = max(err, (p.grad - grads[n]).norm().item() / (grads[n].norm().item() + 1e-2 * total))
            elif (n in grads) != (p.grad is not None):
                err = float("inf")
        row["grad_err"] = err
    except Exception as e:
        row["logprob_err"] = f"raises {one_line(e)}"
    try:  # the generation self-check, where this version of exactrl has it
        from exactrl.rollout.generation_check import check_generation

        g = check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3, sampled=train_mode is None,
                             correction=CORRECTED.get(name, "none"))
        row["gen_check"] = (g.decoder + ("" if g.logprob_error is None else f", log-probs {g.logprob_error:.1e}")
                            + ("" if g.gap_corrected is None else f", gap corrected ({g.gap_corrected})"))
    except ImportError:
        row["gen_check"] = "(none)"
    except Exception as e:
        row["gen_check"] = f"raises {one_line(e)}"
    try:
        model.eval()
        prompts = [[1] + seqs[0][:7], [1] + seqs[2][:3], [1] + seqs[3][:5]]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attention = (ids != 0).long()
        tokens, _ = sample(model, ids, attention, max_new_tokens=16, eos=2, pad=0, greedy=True)
        ref = build(name).eval()
        dsa.break_ties_by_position(ref)
        same = True
        for p, got in zip(prompts, tokens.tolist()):  # Hugging Face's generate on each prompt alone
            want = ref.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                                eos_token_id=2)[0, len(p):].tolist()
            same &= got[: len(want)] == want
        row["generate"] = "same" if same else "DIFFERS"
    except Exception as e:
        row["generate"] = f"raises {one_line(e)}"
    return row


def cli(name: str, tmp: Path) -> dict:
    """exactrl sft and rl, two steps each, as test_arch_matrix.cli_two_steps runs them."""
    import test_arch_matrix
    from archs import save
    from exactrl.tasks.tokenizer import build_tokenizer
    from test_arch_matrix import write_data

    model_dir = save(name, tmp / f"{name}-cli", tokenizer=build_tokenizer())
    data = write_data(tmp / "data.jsonl")
    common = [f"model.path={model_dir}", f"data.train={data}", "data.eval=null", "train.max_steps=2",
              "train.log_every=1",
              "train.micro_batch_size=4", "train.global_batch_size=8"]
    runs = {"sft": ["sft", *common, f"output_dir={tmp / 'sft'}"],
            "rl": ["rl", *common, "algo.group_size=4", "rollout.max_new_tokens=12",
                   f"algo.gen_ratio_tol={getattr(test_arch_matrix, 'GEN_RATIO_TOL', {}).get(name, 1e-4)}",
                   *[f"algo.rollout_correction={c}" for c in [getattr(test_arch_matrix, "CORRECTED", {}).get(name)]
                     if c],
                   "reward.fn=exactrl.tasks.arithmetic:reward", f"output_dir={tmp / 'rl'}"]}
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXACTRL_CACHE": str(tmp / "cache")}
    for phase, args in runs.items():
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], env=env, capture_output=True, text=True,
                                  timeout=600, cwd=ROOT, check=False)
        except subprocess.TimeoutExpired:
            out[phase] = "timeout (600 s)"
            continue
        if proc.returncode == 0:
            out[phase] = f"ok ({time.perf_counter() - t0:.0f} s)"
        else:
            lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
            out[phase] = f"exit {proc.returncode}: {last.strip()[:120]}"
    return out


def worker(name: str, do_cli: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        row = measure(name, Path(d))
        if do_cli:
            row |= cli(name, Path(d))
    print("ROW " + json.dumps(row))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1e}"
    return str(v).replace("|", "/") if v is not None else "-"


def main() -> None:
    from archs import ARCHS

    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--no-cli", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, not args.no_cli)
    names = args.names or list(ARCHS)
    cols = ["name", "check", "path", "logprob_err", "grad_err", "gen_check", "generate", "sft", "rl"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print("\n".join(lines), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in names:
        cmd = [sys.executable, __file__, "--worker", name] + (["--no-cli"] if args.no_cli else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=False)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(found[-1][4:]) if found else {"name": name, "check": f"worker died ({proc.returncode}): "
                                                           + (proc.stderr.strip().splitlines() or [""])[-1][:120]}
        except subprocess.TimeoutExpired:
            row = {"name": name, "check": "worker timed out"}
        line = "| " + " | ".join(fmt(row.get(c)) for c in cols) + " |"
        lines.append(line)
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
