"""The step loop of the commands that train one worker on a fixed data set (dpo, kto, rm): each
step's batch drawn by the sampler and trained by the command's own step, then the same logging,
checkpoint and progress as SFT's."""

from __future__ import annotations

import time
from collections.abc import Callable

from exactrl.algorithms.resume import SFTPosition


def run_steps(ctx, worker, flops, sampler, steps: int, start: int, step: Callable, record: Callable,
              shown: Callable) -> float:
    """Optimizer steps ``start + 1 .. steps``: ``step(n) -> (batch, StepResult)`` trains step n;
    ``record(batch, result)`` adds the command's own counts to the logged record, ``shown(result)``
    to the progress bar. Returns the seconds the steps took."""
    t0 = time.perf_counter()
    ctx.start(steps, start)
    for n in range(start + 1, steps + 1):
        batch, result = step(n)
        flops.trained(batch)
        if ctx.logs(n):
            ctx.write(n, {"loss": result.loss, "epoch": sampler.epoch_of(n), **record(batch, result),
                          **result.metrics, **result.stats, **flops.record(),
                          "wall_seconds": time.perf_counter() - t0})
        ctx.step_done(n, {"policy": worker}, SFTPosition(n, **flops.state()).state(),
                      {"loss": f"{result.loss:.4f}", **shown(result)})
    return time.perf_counter() - t0
