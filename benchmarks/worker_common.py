"""What both measured workers (sft_workers.py, grpo_workers.py) share, on either side.

Runs under exactrl's .venv or under .venv-bench (TRL): it imports torch, and transformers
only inside trl_clock(), never exactrl. A worker's optional last argument is a JSON object of
options (OPTIONS: dtype, device, ...); without it a worker runs as benchmarks/bench.py's CPU runs.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# What a worker runs with when its options leave a key out: bench.py's CPU settings.
OPTIONS = {"dtype": "fp32", "device": "cpu", "max_length": 256, "skip_steps": 0, "exactrl_set": []}


def options(argv: list[str]) -> dict:
    """The worker's options: OPTIONS, updated by the JSON object of ``argv``'s first element if there is one."""
    given = json.loads(argv[0]) if argv else {}
    if unknown := set(given) - set(OPTIONS) - {"lr", "reward"}:
        raise SystemExit(f"worker options: unknown {sorted(unknown)}; known: {sorted(OPTIONS)}, lr, reward")
    return {**OPTIONS, **given}


class Device:
    """The CUDA-only calls the measurements need, each with a CPU branch (the dry run on the CPU takes those)."""

    def __init__(self, name: str):
        self.name, self.cuda = name, name.startswith("cuda")

    def sync(self) -> None:
        """Wait for the queued kernels, so a time stamp marks work done, not work launched."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def peak_memory_mb(self) -> float:
        """The GPU memory PyTorch's allocator held at its peak (tensors only); on the CPU, peak RSS."""
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated() / 2**20
        return peak_rss_mb()

    def describe(self) -> str:
        if self.cuda:
            import torch

            return torch.cuda.get_device_name(0)
        return "cpu"


def count_optimizer_steps(device: Device | None = None) -> dict:
    """A counter of every ``optimizer.step()`` in this process from now on (a global torch hook,
    so it sees a trainer's real steps whatever wraps its optimizer), with the time each ended
    (``times``; after a device sync, the same on both sides)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count = {"steps": 0, "times": []}
    device = device or Device("cpu")

    def hook(optimizer, args, kwargs):
        count["steps"] += 1
        device.sync()
        count["times"].append(time.perf_counter())

    register_optimizer_step_post_hook(hook)
    return count


def trl_clock():
    """A TRL/Trainer callback noting wall times (time.time(), as exactrl's metrics log does)
    at train begin, at the end of every optimizer step and at train end."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.steps, self.end = None, [], None

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.time())

        def on_train_end(self, args, state, control, **kw):
            self.end = time.time()

    return Clock()


def is_oom(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is the device running out of memory."""
    import torch

    while error is not None:
        if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def run(runners: dict, system: str, threads: int, *args, device: str = "cpu") -> None:
    """Run ``runners[system](*args)`` on ``threads`` torch threads; print its row, with the
    process's peak RSS and peak ``device`` memory, as one ``RESULT {json}`` line (what bench.py
    and gpu_bench.py read). Running out of memory is a result, ``{"oom": true}``, not a crash."""
    import torch

    torch.set_num_threads(threads)
    try:
        row = runners[system](*args)
    except Exception as e:
        if not is_oom(e):
            raise
        row = {"oom": True, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    versions = {m: sys.modules[m].__version__ for m in ("exactrl", "trl", "transformers", "torch") if m in sys.modules}
    row.update(system=system, peak_rss_mb=peak_rss_mb(), peak_memory_mb=Device(device).peak_memory_mb(),
               threads=threads, versions=versions)
    print("RESULT " + json.dumps(row), flush=True)
