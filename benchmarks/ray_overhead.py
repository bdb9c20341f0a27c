"""Ray's overhead: the same seeded GRPO run (examples/grpo_tiny.yaml) in one process and as Ray
actor groups, side by side, on this machine.

usage: .venv/bin/python benchmarks/ray_overhead.py [steps] [repeats]

Each variant runs ``exactrl rl`` as a user would (its own process, no evaluation, a log line every
step) ``repeats`` times, interleaved: plain, Ray colocated with one engine, Ray colocated with two
engines, Ray split (trainer and engine on bundles of their own). The time per optimizer step is the
median of the differences of ``wall_seconds`` between consecutive logged steps after the first (the
first carries start-up and warm-up); start-up (the whole command's wall time minus the steps) is
printed beside it. Prints `RATIO ray/plain[<variant>] = X.XXX` per Ray variant (the median over
repeats of the per-step ratio). The final weights of the plain and Ray runs are compared too: the
same seed must end at the same weights (tests/test_ray.py asserts it; here it is reported).
Asynchronous rollouts (ray.async_rollouts) change the maths (each rollout is sampled one update
behind), so their Ray run is compared with the same schedule run in sequence in one process
(plain-async), and its step time with the plain synchronous run's: what overlapping sampling with
training buys when the engine has cores of its own.

On one 2-core CPU machine the Ray variants pay for their processes (each actor one thread, the
driver and the actors sharing two cores), the weight push to an engine that holds its own copy,
and the object store; they buy nothing here: Ray is for several machines and GPUs.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXACTRL = str(Path(sys.executable).with_name("exactrl"))
VARIANTS = {
    "plain": [],
    "ray-colocated-1": ["ray.enabled=true"],
    "ray-colocated-2": ["ray.enabled=true", "ray.engines=2"],
    "ray-split-1": ["ray.enabled=true", "ray.placement=split"],
    # asynchronous rollouts: the one-update-stale schedule, in sequence in one process and overlapped under Ray
    "plain-async": ["ray.async_rollouts=true", "algo.rollout_correction=tis"],
    "ray-split-1-async": ["ray.enabled=true", "ray.placement=split", "ray.async_rollouts=true",
                          "algo.rollout_correction=tis"],
}
# the run whose final weights each variant must end at: the plain run of its own schedule
SAME_MATHS = {"plain-async": "plain-async", "ray-split-1-async": "plain-async"}


def run(name: str, steps: int, out: Path) -> dict:
    args = [EXACTRL, "rl", "--config", str(ROOT / "examples/grpo_tiny.yaml"), f"train.max_steps={steps}",
            "train.log_every=1", "data.eval=null", f"output_dir={out}", *VARIANTS[name]]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    walls = [json.loads(line)["wall_seconds"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"wall_seconds"' in line]
    per_step = statistics.median(b - a for a, b in itertools.pairwise(walls[1:]))
    return {"step": per_step, "startup": total - walls[-1], "total": total, "final": out / "final"}


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def main(steps: int = 12, repeats: int = 3) -> None:
    from exactrl.algorithms.sft import resolve

    resolve("builtin-sft", "model")  # built once and cached, before anything is timed
    results = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in VARIANTS:
                res = run(name, steps, Path(tmp) / f"{name}-{r}")
                results[name].append(res)
                print(f"{name} #{r}: {res['step']:.3f} s/step, start-up {res['startup']:.1f} s, "
                      f"total {res['total']:.1f} s", flush=True)
        plain = results["plain"]
        print(f"\n{os.cpu_count()} CPUs, torch {torch.__version__}, {steps} steps of examples/grpo_tiny.yaml, "
              f"{repeats} repeats, medians:")
        for name, rs in results.items():
            print(f"  {name:16s} {statistics.median(r['step'] for r in rs):.3f} s/step, start-up "
                  f"{statistics.median(r['startup'] for r in rs):.1f} s")
        for name, rs in results.items():
            if name == "plain":
                continue
            ratio = statistics.median(r["step"] / p["step"] for r, p in zip(rs, plain))
            same = SAME_MATHS.get(name, "plain")
            diff = max(max_diff(p["final"], r["final"]) for r, p in zip(rs, results[same])) if same != name else None
            versus = "" if diff is None else f"  (final weights vs {same}: max |diff| {diff:.2g})"
            print(f"RATIO ray/plain[{name}] = {ratio:.3f}{versus}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
