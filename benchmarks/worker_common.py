"""What both measured workers (sft_workers.py, grpo_workers.py) share, on either side.

Runs under exactrl's .venv or under .venv-bench (TRL): it imports torch, and transformers
only inside trl_clock(), never exactrl.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def count_optimizer_steps() -> dict:
    """A counter of every ``optimizer.step()`` in this process from now on (a global torch hook,
    so it sees a trainer's real steps whatever wraps its optimizer)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count = {"steps": 0}

    def hook(optimizer, args, kwargs):
        count["steps"] += 1

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


def run(runners: dict, system: str, threads: int, *args) -> None:
    """Run ``runners[system](*args)`` on ``threads`` torch threads; print its row, with the
    process's peak RSS, as one ``RESULT {json}`` line (what bench.py reads)."""
    import torch

    torch.set_num_threads(threads)
    row = runners[system](*args)
    versions = {m: sys.modules[m].__version__ for m in ("exactrl", "trl", "transformers", "torch") if m in sys.modules}
    row.update(system=system, peak_rss_mb=peak_rss_mb(), threads=threads, versions=versions)
    print("RESULT " + json.dumps(row), flush=True)
