"""`exactrl rm rm.kind=process`: a process reward model (PRM), one score per step, exact over the step's steps.

Lightman et al. 2023 ("Let's Verify Step by Step") and TRL's PRMTrainer: a solution is cut into steps, each
followed by a separator; the reward model's scalar head read at the separator's last token gives the step's logit.
Per optimizer step:
  1. the sampler draws the step's step-labelled rows (independent of micro-batch size and ranks);
  2. each row is one sample whose loss targets are its steps (data/steps.py StepExample.sample), so the plan
     counts the labelled steps of the whole step before the first backward;
  3. each micro-batch backpropagates the binary cross-entropy of its steps' logits against their labels over the
     step's number of labelled steps (losses/process.py ProcessTerm);
  4. the worker checks every sample was seen once (the canary) and the engine steps.
At the end, on data.eval's rows: the step accuracy (a logit > 0 says "correct") and the accuracy of the first wrong
step (the first step scored <= 0, or none, against the first step labelled false, or none), each with a Wilson 95%
interval beside its majority baseline; and final/reward_stats.json, the mean and std of the final model's step
logits over the first rm.stats_pairs training rows, with the separator a scorer must cut steps at.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import torch

from exactrl.algorithms.common import check_world
from exactrl.algorithms.offline import RMResult, prepare_offline, run_steps
from exactrl.algorithms.sft import resolve
from exactrl.config.aggregation import norm_len
from exactrl.config.loader import ConfigError
from exactrl.config.schema_rm import RMConfig
from exactrl.data.batch import Sample
from exactrl.data.steps import StepExample, load_steps
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Objective
from exactrl.losses.process import ProcessTerm
from exactrl.models.loading import load_tokenizer
from exactrl.run.evaluation import eval_data, wilson_interval
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.tasks.preference import STEP_SEPARATOR
from exactrl.workers.reward_model import STATS_FILE
from exactrl.workers.worker import Worker


def prm_objective(cfg: RMConfig) -> Objective:
    return Objective((ProcessTerm(agg=cfg.train.loss_agg, norm_len=norm_len(cfg)
                                  if cfg.train.loss_agg == "seq-mean-token-sum-norm" else None),))


def separator(cfg: RMConfig) -> str:
    """rm.step_separator, else the built-in steps' own (their text as the policy writes it) or TRL's newline."""
    if cfg.rm.step_separator is not None:
        return cfg.rm.step_separator
    return STEP_SEPARATOR if cfg.data.train == "builtin" else "\n"


def _layout(rows: int, per_forward: int, world: int) -> list[list[list[int]]]:
    """Every rank's micro-batches over ``rows`` samples, as even as can be and the same number on each rank (a
    sharded model's forwards are collectives)."""
    chunks = world * max(1, math.ceil(rows / (per_forward * world)))
    if rows < chunks:
        raise ConfigError(f"{rows} rows cannot give each of {world} ranks one to score; use more rows")
    bounds = [i * rows // chunks for i in range(chunks + 1)]
    parts = [list(range(bounds[i], bounds[i + 1])) for i in range(chunks)]
    return [parts[r::world] for r in range(world)]


def score_steps(model: Worker, examples: list[StepExample], rows_per_forward: int) -> list[torch.Tensor]:
    """Each row's step logits (no gradient): the head at each separator's last token."""
    samples = [e.sample() for e in examples]
    per_target = model.forward(samples, "scores", _layout(len(samples), rows_per_forward, model.world_size))
    return [v[e.targets].double() for e, v in zip(examples, per_target)]


def first_wrong(correct: list[bool]) -> int | None:
    """The index of the first step judged wrong, None when every step is judged correct."""
    return next((i for i, ok in enumerate(correct) if not ok), None)


def step_accuracy(scores: list[torch.Tensor], labels: list[list[bool]]) -> dict:
    """The share of steps whose logit's sign is the label (> 0: correct) and the share of rows whose first step
    scored <= 0 is the first step labelled wrong (both none counts as right), with Wilson 95% intervals; beside each,
    the majority baseline: always the more frequent label, always the most frequent first wrong step."""
    said = [(s > 0).tolist() for s in scores]
    k = sum(p == y for ps, ys in zip(said, labels) for p, y in zip(ps, ys))
    n = sum(len(ys) for ys in labels)
    truth = [first_wrong(ys) for ys in labels]
    k_first = sum(first_wrong(ps) == t for ps, t in zip(said, truth))
    positive = sum(y for ys in labels for y in ys)
    return {"step_accuracy": k / n, "ci95": list(wilson_interval(k, n)), "correct": k, "n": n,
            "majority_baseline": max(positive, n - positive) / n,
            "first_wrong_accuracy": k_first / len(labels), "first_wrong_ci95": list(wilson_interval(k_first,
                                                                                                    len(labels))),
            "first_wrong_correct": k_first, "rows": len(labels),
            "first_wrong_majority_baseline": Counter(truth).most_common(1)[0][1] / len(labels)}


def step_stats(scores: list[torch.Tensor], labels: list[list[bool]]) -> dict:
    """Mean and std (population, ddof 0) of the step logits, over all steps and per label."""
    every = torch.cat(scores)
    mask = torch.tensor([y for ys in labels for y in ys])
    out = {"mean": float(every.mean()), "std": float(every.std(correction=0)), "n": every.numel()}
    for name, part in (("correct", every[mask]), ("wrong", every[~mask])):
        if part.numel():
            out |= {f"{name}_mean": float(part.mean()), f"{name}_std": float(part.std(correction=0)),
                    f"{name}_n": part.numel()}
    return out


def train_prm(cfg: RMConfig, run_dir=None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "rm",
              final_name: str = "final") -> RMResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t, sep = cfg.train, separator(cfg)
    objective = prm_objective(cfg)
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "steps_train", spec), resolve(eval_data(cfg), "steps_eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    rows, note = load_steps(train_path, tok, cfg.data, sep)  # every row read and checked before the model loads
    held_out, eval_note = load_steps(eval_path, tok, cfg.data, sep) if eval_path else ([], None)
    held_out = held_out[: cfg.data.eval_size]
    for n in (note, eval_note):
        if n and is_main():
            print(n)
    run = prepare_offline(cfg, "rm", phase, run_dir, len(rows), "samples", {"train": train_path, "eval": eval_path},
                          tok, None, "reward_model", model_path)
    ctx, model, steps, start, flops, sampler = run.ctx, run.worker, run.steps, run.start, run.flops, run.sampler
    samples: list[Sample] = [e.sample() for e in rows]

    def step(n: int):
        batch = [samples[i] for i in sampler.batch(n - 1)]
        plan = plan_samples(batch, t.micro_batch_size, t.loss_agg, objective.terms[0].norm_len, model.world_size,
                            sort=True)
        return batch, model.train_step(batch, plan, objective)

    seconds = run_steps(ctx, model, flops, sampler, steps, start, step,
                        lambda batch, r: {"rows": len(batch), "labelled_steps": sum(s.loss_tokens for s in batch)},
                        lambda r: {"acc": f"{r.metrics.get('step_accuracy', 0):.2f}"})

    # The final model's step logits: statistics over the training rows, accuracy over the held-out ones.
    stats_rows = rows[: cfg.rm.stats_pairs]
    stats = {"kind": "process", "score_position": "each step separator's last token (a logit: > 0 = correct)",
             "step_separator": sep, "train": step_stats(score_steps(model, stats_rows, t.micro_batch_size),
                                                        [e.labels for e in stats_rows]), "train_file": str(train_path)}
    if held_out:
        stats |= {"eval": step_accuracy(score_steps(model, held_out, t.micro_batch_size),
                                        [e.labels for e in held_out]), "eval_file": str(eval_path)}
        e = stats["eval"]
        ctx.write(steps, {"eval_step_accuracy": e["step_accuracy"], "eval_ci95": e["ci95"],
                          "eval_first_wrong_accuracy": e["first_wrong_accuracy"],
                          "eval_first_wrong_ci95": e["first_wrong_ci95"]})
        if is_main():
            print(f"[{phase}] held-out step accuracy on {e['n']} steps {100 * e['step_accuracy']:.1f}% "
                  f"[{100 * e['ci95'][0]:.1f}, {100 * e['ci95'][1]:.1f}] (majority label "
                  f"{100 * e['majority_baseline']:.1f}%); first wrong step on {e['rows']} rows "
                  f"{100 * e['first_wrong_accuracy']:.1f}% [{100 * e['first_wrong_ci95'][0]:.1f}, "
                  f"{100 * e['first_wrong_ci95'][1]:.1f}] (majority {100 * e['first_wrong_majority_baseline']:.1f}%)")
    final = ctx.finish({final_name: model})
    if is_main():  # beside config.json: what a scorer needs, where to score and how to normalise
        (final / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return RMResult(ctx.run_dir, final, steps, seconds, stats)
