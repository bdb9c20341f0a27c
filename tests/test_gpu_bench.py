"""benchmarks/gpu_bench.py --dry-run: the GPU benchmark's every step at tiny sizes on the CPU (issue 38).

The run is exactrl's side only (--no-trl: TRL is not in .venv, and where `make bench` built .venv-bench its
side would double the time; `gpu_bench.py --dry-run` alone runs it there). Its figures must be real: the
trained tokens each exactrl run counted equal the tokens of the rows it read (one word a token, plus the
end-of-sequence token exactrl appends to each completion), counted here from the rows themselves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench  # noqa: E402
from worker_common import is_oom  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--dry-run", "--no-trl", "--results-dir",
                           str(results)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (page,) = results.glob("gpu-bench-*.md")
    return proc.stdout, page.read_text()


def words_and_rows(tmp_path, rows: int) -> int:
    """Tokens exactrl trains on in the first ``rows`` SFT rows: the words of prompt and completion, and an EOS."""
    data = gpu_bench.sft_rows(tmp_path, gpu_bench.SIZES["dry"], rows)
    return sum(len(r["prompt"].split()) + len(r["completion"].split()) + 1
               for r in map(json.loads, data.read_text().splitlines()))


def test_dry_run_prints_real_exactrl_figures(dry_run):
    out, _ = dry_run
    (mfu, peak), = re.findall(r"^MFU sft exactrl batch 2 = ([\d.]+)% of measured fp32 GEMM peak ([\d.]+) GFLOP/s$",
                              out, re.M)
    assert float(mfu) > 0 and float(peak) > 0
    (tps,) = re.findall(r"^sft exactrl batch 2 rep 0: ([\d,]+) tokens/s over 2 steps", out, re.M)
    assert float(tps.replace(",", "")) > 0
    assert re.search(r"^grpo exactrl batch 0 rep 0: [\d.]+ steps/s", out, re.M)
    # without TRL every ratio says why it has no value, never a number made up
    ratios = re.findall(r"^RATIO (\S+) exactrl/trl(?: batch \d+)? = (.*)$", out, re.M)
    assert {name for name, _ in ratios} == {"sft_tokens_per_s", "grpo_steps_per_s"}
    assert all(value == "n/a (not run (--no-trl))" for _, value in ratios), ratios
    assert re.search(r"^SWEEP exactrl: largest batch that fit = 4; 2: [\d.]+ GB, 4: [\d.]+ GB$", out, re.M)


def test_results_page_has_the_table_and_each_run_counted_its_rows(dry_run, tmp_path):
    _, page = dry_run
    assert "| batch (tokens/step) | exactrl tokens/s (runs) | TRL tokens/s (runs) | ratio |" in page
    assert re.search(r"^\| 2 \(~[\d.]+k\) \| [\d.]+k \| not run \(--no-trl\) \| — \|", page, re.M)
    assert "| batch | exactrl | TRL |" in page and "| system | steps/s | generated tokens/s |" in page
    runs = [json.loads(line) for line in page.split("## Every run")[1].strip("`\n").splitlines()]
    sft = {r["batch"]: r for r in runs if r["kind"] == "sft" and r["system"] == "exactrl"}
    assert sorted(sft) == [2, 4]
    # the table's run: 3 steps of 2 rows, the sweep's: 2 steps of 4 rows; all tokens counted, the timed ones a part
    for batch, steps in ((2, 3), (4, 2)):
        r = sft[batch]
        assert (r["steps"], r["timed_steps"]) == (steps, steps - 1)
        assert r["all_tokens"] == words_and_rows(tmp_path, batch * steps)
        assert 0 < r["tokens"] < r["all_tokens"] and r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 0
    (grpo,) = [r for r in runs if r["kind"] == "grpo" and r["system"] == "exactrl"]
    assert grpo["optimizer_steps"] == 2 and grpo["completions_per_step"] == [4] and grpo["gen_tokens"] > 0
    assert all(r["skipped"] == "not run (--no-trl)" for r in runs if r["system"] == "trl")


def test_running_out_of_memory_is_recognised_through_wrappers():
    """The sweep records an OOM as a result: the worker knows one even when a trainer re-raised it."""
    import torch

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except Exception as e:
            raise RuntimeError("step 3 failed") from e
    except RuntimeError as wrapped:
        assert is_oom(wrapped)
    assert not is_oom(ValueError("shapes do not match"))
