"""What the commands that train one worker on a fixed data set (dpo, kto, rm, its process form, kd) share:
their set-up once the data is read (steps, the run directory, the worker, the resumed position), the step
loop (each step's batch drawn by the sampler and trained by the command's own step, then the same logging,
checkpoint and progress as SFT's), dpo's and kto's reference cache and held-out pairwise accuracy."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from exactrl.algorithms.common import check_data_size, steps_for
from exactrl.algorithms.resume import SFTPosition, prepare_resume
from exactrl.algorithms.sft import resolve
from exactrl.compute import FlopsCounter, count_parameters
from exactrl.data.batch import Sample
from exactrl.data.batching import StepSampler
from exactrl.data.preference import PairExample, load_pairs
from exactrl.distributed.checkpoint import resume
from exactrl.distributed.launch import is_main
from exactrl.losses.preference import PairInput
from exactrl.run.context import RunContext
from exactrl.run.evaluation import pairwise_accuracy, pairwise_report
from exactrl.workers.reference_cache import ReferenceCache, cache_key, forward_layout, forward_settings
from exactrl.workers.worker import Worker


@dataclass
class RMResult:  # exactrl rm's result, pairwise or process (prm.py)
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    stats: dict


@dataclass
class OfflineRun:
    """A command's run once set up: its directory and logs, the trained worker, its steps, where it resumes."""
    ctx: RunContext
    worker: Worker
    steps: int
    start: int  # the last step done (0: a fresh run)
    flops: FlopsCounter
    sampler: StepSampler
    where: dict  # what Worker.build needs to build another worker of this run (a reference, a teacher)


def prepare_offline(cfg, command: str, phase: str, run_dir: Path | None, items: int, what: str, paths: dict, tok,
                    eval_set, role: str, model_path: str) -> OfflineRun:
    """Once the data (``items`` rows, called ``what`` in errors) is read and checked: the steps, the refusal of a
    data set too small for one step, the resume check, the run directory, the worker ``role`` built from
    ``model_path`` (or the checkpoint being resumed), its position and FLOPs so far, and the step sampler."""
    t = cfg.train
    steps = steps_for(t, items, t.global_batch_size)
    check_data_size(items, t.global_batch_size, what, paths["train"])
    continues = prepare_resume(cfg, command, steps)
    ctx = RunContext(cfg, command, phase, run_dir, paths, tok, eval_set, continues)
    where = {"run_dir": ctx.run_dir, "phase": phase, "longest": cfg.data.max_length, "pad_id": tok.pad_token_id}
    worker = Worker.build(cfg, role, model_path, total_steps=steps, checkpoint=t.resume_from, **where)
    position = SFTPosition.load(resume(t.resume_from, {"policy": worker}) if t.resume_from else {"step": 0})
    flops = FlopsCounter(count_parameters(worker.model))
    flops.load(position.state())
    return OfflineRun(ctx, worker, steps, position.step, flops, StepSampler(items, t.global_batch_size, t.seed), where)


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


def reference_cache(cfg, section, reference_path: str, data: list[Sample], needed: list[Sample], build: Callable,
                    run_dir) -> ReferenceCache | None:
    """``section.reference_cache=precompute``: the cache of the reference at ``reference_path`` for the data set
    ``data`` (every sequence of it, which names the file), filled with every sequence in ``needed`` (the run's
    steps' and held-out ones); ``build()`` makes the reference worker, called only if some are missing.
    None when the reference scores each step on the fly."""
    if section.reference_cache == "none":
        return None
    directory = Path(section.reference_cache_dir or Path(run_dir).parent / "reference-cache")
    cache = ReferenceCache(directory, cache_key(reference_path, forward_settings(cfg), data))
    computed = cache.fill(needed, build, cfg.train.micro_batch_size)
    if is_main():
        print(f"reference log-probs: {len(needed) - computed} of {len(needed)} sequences read from {cache.path}"
              + (f", {computed} computed" if computed else ""))
    return cache


def reference_logprobs(cache: ReferenceCache | None, reference, samples: list[Sample], layout) -> list[torch.Tensor]:
    """The reference's per-token log-probs of ``samples``: from the cache, else its forward in ``layout``."""
    return cache.logprobs(samples) if cache is not None else reference.forward(samples, "logprobs", layout)


def heldout_pairwise(ctx, policy, held_out: list[PairExample], rewards: Callable, ref: Callable | None,
                     per_forward: int, step: int) -> dict | None:
    """The policy's implicit-reward pairwise accuracy on ``held_out`` (run/evaluation.py pairwise_accuracy,
    as exactrl rm's: the share of pairs whose chosen reward beats the rejected one's, Wilson 95% interval),
    logged and printed.
    ``rewards(PairInput)`` gives (chosen, rejected) rewards [P]; ``ref(samples, layout)`` the reference's
    log-probs (None: reference-free)."""

    if not held_out:
        return None
    samples = [s for p in held_out for s in p.samples()]
    layout = forward_layout(len(samples), 2 * per_forward, policy.world_size)
    masks = [torch.tensor(s.loss_mask, dtype=torch.float64) for s in samples]

    def sums(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(v.double() * m).sum() for v, m in zip(values, masks)])

    tokens = torch.stack([m.sum() for m in masks])
    pol, refs = sums(policy.forward(samples, "logprobs", layout)), None if ref is None else sums(ref(samples, layout))
    x = PairInput(chosen=pol[0::2], rejected=pol[1::2], chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2],
                  ref_chosen=None if refs is None else refs[0::2], ref_rejected=None if refs is None else refs[1::2])
    out = pairwise_accuracy(*rewards(x), [p.kind for p in held_out])
    per_kind, lines = pairwise_report(out, " (implicit reward)")
    ctx.write(step, {"eval_pairwise_accuracy": out["pairwise_accuracy"], "eval_pairwise_ci95": out["ci95"],
                     "eval_reward_margin": out["mean_margin"], "eval_pairs": out["n"]} | per_kind)
    if is_main():
        lines[0] += f", mean reward margin {out['mean_margin']:.4f}"
        for line in lines:
            print(f"[{ctx.phase}] {line}")
    return out


def load_eval_pairs(cfg, tok, spec) -> tuple[list[PairExample], str | None]:
    """data.eval_pairs' first data.eval_size pairs ('auto': the built-in held-out pairs for built-in training data)
    and their path; ([], None) when there are none."""
    name = cfg.data.eval_pairs
    if name == "auto":
        name = "builtin" if cfg.data.train == "builtin" else None
    path = resolve(name, "pairs_eval", spec)
    if not path:
        return [], None
    pairs, note = load_pairs(path, tok, cfg.data)
    if note and is_main():
        print(note)
    return pairs[: cfg.data.eval_size], path
