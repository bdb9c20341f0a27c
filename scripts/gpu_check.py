"""make gpu-check: does exactrl train exactly on this machine's GPUs?

1. the gradient-equivalence subset on CUDA (tests marked `gpu`, tests/test_gpu.py: micro-batches
   vs the full batch in fp32 and bf16, packed vs padded, FSDP2 at world size 2 over NCCL with
   two or more GPUs), and no host sync per micro-batch (tests/test_host_syncs.py);
2. a short SFT and a short GRPO run in fp32 and bf16, at world size 1 and, with several GPUs,
   2 (FSDP2 over NCCL), each checked by the canary at every step;
3. a short GRPO run under Ray (`ray-<dtype>`: trainer ranks and a rollout engine as actors, split
   over two GPUs or colocated on one) sampling with vLLM when this environment or --vllm-python
   has it (else Hugging Face engines; split, the weights go over NCCL, GPU to GPU; colocated,
   over gloo), every weight sync verified (digest, probe), the
   rollout-trainer gap measured at every rollout;
4. a short GRPO run sampling with vLLM without Ray (`vllm-<dtype>`: each trainer rank starts an
   engine on its own GPU, which sleeps while the rank trains, rollout.vllm.sleep_level=auto),
   reporting the same and what each sleep freed;
then a PASS/FAIL table with the figures (equivalence errors, tokens/s, peak GPU memory); what this machine has
too few GPUs (or no vLLM) for is a SKIP row with the reason. Exit code 1 on any FAIL.

--dry-run: the same on the CPU (distributed.device=cpu, gloo, world size 1, fewer steps), so
the script itself is tested where there is no GPU (tests/test_gpu_check.py).

usage: python scripts/gpu_check.py [--dry-run] [--steps N] [--runs sft-fp32,grpo-bf16,ray-fp32,...]
                                   [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tests(dry: bool, work: Path) -> list[tuple]:
    figures = work / "figures.jsonl"
    env = {**os.environ, "EXACTRL_GPU_FIGURES": str(figures), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if dry:
        env["EXACTRL_GPU_DRY_RUN"] = "1"
    t0 = time.perf_counter()
    report = work / "tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           f"--junitxml={report}",
                           str(ROOT / "tests" / "test_gpu.py"), str(ROOT / "tests" / "test_host_syncs.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-2000:], file=sys.stderr)
    rows = [("tests -m gpu", "PASS" if proc.returncode == 0 else "FAIL", summary, f"{time.perf_counter() - t0:.0f} s")]
    if report.exists():  # each skipped test with its reason, e.g. FSDP2 over NCCL on one GPU
        import xml.etree.ElementTree as ET

        rows += [(f"  {case.get('name')}", "SKIP", skip.get("message", ""), "")
                 for case in ET.parse(report).iter("testcase") for skip in case.findall("skipped")]
    for line in figures.read_text().splitlines() if figures.exists() else []:
        f = json.loads(line)
        rows.append((f"  {f['test']}", "", f"{f['figure']} = {f['value']:.3g}", ""))
    return rows


def vllm_python(given: str | None) -> str | None:
    """The interpreter whose environment has vLLM: --vllm-python, this one, or `make vllm`'s .venv-vllm."""
    if given:
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    built = ROOT / ".venv-vllm" / "bin" / "python"
    return str(built) if built.exists() else None


def run_training(kind: str, dtype: str, world: int, dry: bool, steps: int, work: Path, vllm: str | None = None,
                 gpus: int = 0) -> tuple:
    name = f"{kind} {dtype} world {world}" + (f" ({'vllm' if vllm else 'hf'} engine)" if kind == "ray" else "")
    if kind == "vllm" and not vllm:
        return (name, "SKIP", "no environment with vLLM (--vllm-python, or make vllm)", "")
    if kind == "ray" and importlib.util.find_spec("ray") is None:
        return (name, "SKIP", "Ray is not installed here (pip install -e '.[ray]')", "")
    out = work / f"{kind}-{dtype}-w{world}.json"
    child = [str(Path(__file__).resolve()), "--child", kind, dtype, "cpu" if dry else "cuda", str(steps), str(out),
             vllm or "", str(gpus)]
    # Ray starts its trainer ranks itself
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] \
        if world > 1 and kind != "ray" else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "EXACTRL_GPU_CHECK_WORLD": str(world)}
    proc = subprocess.run([sys.executable, *launcher, *child], cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        print(f"--- {name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return (name, "FAIL", f"exit code {proc.returncode}", "")
    r = json.loads(out.read_text())
    ok = math.isfinite(r["loss"]) and all(abs(c - 1) <= 1e-5 for c in r["canary"])
    memory = "n/a (cpu)" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f} GB peak"
    sync = "" if r.get("probe_error") is None else (f", sync probe {r['probe_error']:.2g}, rollout gap "
                                                    f"{r['gap_abs_max']:.2g}" + (f", {r['channel']} weight channel"
                                                                                 if r.get("channel") else "") + (
        f", each sleep freed {r['sleep_freed_gb']:.2f} GB" if r.get("sleep_freed_gb") is not None else ""))
    return (name, "PASS" if ok else "FAIL", f"loss {r['loss']:.4f}, canary {min(r['canary'], default=1):.7f}, "
            f"{r['tokens_per_s']:.0f} tokens/s{sync}", memory)


def ray_settings(world: int, vllm: str, gpus: int) -> list[str]:
    """A Ray run: `world` trainer ranks and one engine, split over their own GPUs when there are enough, else
    colocated on them (vLLM then takes a third of the memory the trainer also uses)."""
    split = gpus >= world + 1
    out = ["ray.enabled=true", f"ray.ranks={world}", "ray.engines=1",
           f"ray.placement={'split' if split else 'colocated'}"]
    if vllm:
        out += ["rollout.engine=vllm", f"rollout.vllm.python={vllm}"] + ([] if split else [
            "rollout.vllm.gpu_memory_utilization=0.3"])
    return out


def child(kind: str, dtype: str, device: str, steps: int, out: str, vllm: str = "", gpus: int = 0) -> None:
    """One short run in this process (one rank of it under torchrun; a Ray run's driver); rank 0 writes the figures."""
    import torch

    from exactrl.config import RLConfig, SFTConfig, load_config
    from exactrl.distributed.launch import is_main, shutdown, world_size
    from exactrl.tasks.builtin import BuiltinSpec

    world = int(os.environ.get("EXACTRL_GPU_CHECK_WORLD", "1")) if kind == "ray" else world_size()
    common = [f"distributed.device={device}", f"model.dtype={dtype}", f"train.max_steps={steps}", "train.log_every=1",
              "data.eval=null", f"output_dir={Path(out).with_suffix('')}",
              f"distributed.backend={'fsdp2' if world > 1 else 'single'}"]
    common += ray_settings(world, vllm, gpus) if kind == "ray" else [f"distributed.nproc_per_node={world}"]
    if kind == "vllm":  # each rank's engine shares its GPU with the rank, and sleeps while it trains
        common += ["rollout.engine=vllm", f"rollout.vllm.python={vllm}", "rollout.vllm.gpu_memory_utilization=0.3"] + (
            ["rollout.vllm.cpu_kv_cache_gb=1"] if device == "cpu" else [])
    spec = BuiltinSpec(n_sft=64, n_rl=64, n_eval=8)
    if kind == "sft":
        from exactrl.algorithms.sft import train_sft

        cfg = load_config(SFTConfig, None, [*common, "train.global_batch_size=16",
                                            f"train.micro_batch_size={8 // world}"])
        result, tokens = train_sft(cfg, spec=spec), None
        tokens = result.trained_tokens
    else:
        from exactrl.algorithms.rl import train_rl

        cfg = load_config(RLConfig, None, [*common, "train.global_batch_size=16",
                                           f"train.micro_batch_size={8 // world}",
                                           "algo.name=grpo", "algo.group_size=4", "rollout.max_new_tokens=16",
                                           "reward.fn=exactrl.tasks.arithmetic:reward"])
        result = train_rl(cfg, spec=spec)
        tokens = result.generated_tokens
    if is_main():
        lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        logged = [x for x in lines if "loss" in x]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        freed = [x["engine_sleep_freed_gb"] for x in logged if "engine_sleep_freed_gb" in x]
        sync = {"probe_error": max(x["sync_probe_error"] for x in logged),
                "gap_abs_max": max(x.get("rollout_gap/abs_max", 0.0) for x in logged),
                # the vLLM engines' (NCCL when split over GPUs): exactrl/workers/groups.py RayRoles.channel_backend
                "channel": json.loads((result.run_dir / "manifest.json").read_text()).get("ray", {}).get(
                    "weight_channel"), "sleep_freed_gb": min(freed) if freed else None} if kind in ("ray", "vllm") \
            else {}
        Path(out).write_text(json.dumps({"loss": logged[-1]["loss"], "canary": [x["canary"] for x in logged if x.get(
            "canary") is not None],
                                         "tokens_per_s": tokens / result.seconds, "peak_memory_gb": peak, **sync}))
    shutdown()


def skipped_for_want_of_gpus(gpus: int, runs: list[str]) -> list[tuple]:
    """SKIP rows for what this machine has too few GPUs to check, so a one-GPU PASS does not read as all of it."""
    have = f"this machine has {gpus}" + (" (dry run)" if gpus == 0 else "")
    rows = []
    if gpus < 2:
        rows.append(("world 2 runs (FSDP2 over NCCL)", "SKIP", f"needs 2 GPUs; {have}", ""))
    if gpus < 2 and any(r.startswith("ray-") for r in runs):
        rows.append(("ray split (NCCL weight channel)", "SKIP",
                     f"needs a GPU for the trainer and one for the engine; {have}: the ray runs were colocated", ""))
    return rows


def print_table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="run everything on the CPU (gloo, world size 1)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (default 20 on GPU, 2 dry)")
    p.add_argument("--runs", default="sft-fp32,sft-bf16,grpo-fp32,grpo-bf16,ray-fp32,ray-bf16,vllm-fp32,vllm-bf16",
                   help="which training runs (kind-dtype, comma-separated; kind sft, grpo, ray or vllm)")
    p.add_argument("--vllm-python", default=None,
                   help="interpreter of an environment with vLLM for the ray and vllm runs (default: this one if it "
                        "has vLLM, else .venv-vllm's; else the ray runs take Hugging Face engines, the vllm runs skip)")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, dtype, device, steps, out, vllm, gpus = args.child
        child(kind, dtype, device, int(steps), out, vllm, int(gpus))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu-check: this torch ({torch.__version__}) sees no CUDA device; install a CUDA build (make gpu-check "
              "TORCH=\"torch==... --index-url https://download.pytorch.org/whl/cu128\") or pass --dry-run")
        return 2
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    steps = args.steps or (2 if args.dry_run else 20)
    where = "CPU (dry run)" if args.dry_run else f"{gpus} x {torch.cuda.get_device_name(0)}"
    print(f"gpu-check on {where}, torch {torch.__version__}")
    rows = [("check", "result", "figures", "")]
    with tempfile.TemporaryDirectory(prefix="exactrl-gpu-check-") as tmp:
        work = Path(tmp)
        rows += run_tests(args.dry_run, work)
        for world in [1, 2] if gpus >= 2 else [1]:
            for run in args.runs.split(","):
                kind, dtype = run.split("-")
                rows.append(run_training(kind, dtype, world, args.dry_run, steps, work,
                                         vllm_python(args.vllm_python) if kind in ("ray", "vllm") else None, gpus))
    rows += skipped_for_want_of_gpus(gpus, args.runs.split(","))
    print_table(rows)
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    print(f"gpu-check: {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
