"""`exactrl rm`: a Bradley-Terry reward model on preference pairs, exact per pair.

Per optimizer step:
  1. the sampler draws the step's pairs (independent of micro-batch size and ranks);
  2. the step plan keeps each pair's two sequences together (unit=2) and counts the step's pairs;
  3. each micro-batch scores its answers at their last real token (workers/reward_model.py) and
     backpropagates -log sigma(r_c - r_r [- margin]) [+ c (r_c + r_r)^2] over the step's number of pairs
     (losses/pairs.py ScoreTerm);
  4. the worker checks every sample was seen once (the canary) and the engine steps.
At the end: the held-out pairwise accuracy (share of data.eval's pairs whose chosen answer scores above the
rejected one, Wilson 95% interval), and the mean and std of the final model's scores over both answers of
the first rm.stats_pairs training pairs, saved as final/reward_stats.json for a scorer to normalise with.
With rm.kind=process, a process reward model on step-labelled rows instead (algorithms/prm.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from exactrl.algorithms.common import check_world
from exactrl.algorithms.offline import RMResult, prepare_offline, run_steps
from exactrl.algorithms.sft import resolve
from exactrl.config.loader import ConfigError
from exactrl.config.schema_rm import RMConfig
from exactrl.data.batch import Sample
from exactrl.data.preference import PairExample, load_pairs
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Objective
from exactrl.losses.pairs import ScoreTerm
from exactrl.losses.preference import PairParams
from exactrl.models.loading import load_tokenizer
from exactrl.run.evaluation import eval_data, pairwise_accuracy, pairwise_report
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reward_model import STATS_FILE, score_layout
from exactrl.workers.worker import Worker


def rm_objective(cfg: RMConfig) -> Objective:
    return Objective((ScoreTerm(params=PairParams(center_rewards=cfg.rm.center_rewards), margin=cfg.rm.margin),))


def _check_margins(cfg: RMConfig, pairs: list[PairExample], path) -> None:
    missing = next((p for p in pairs if p.margin is None), None)
    if cfg.rm.margin and missing is not None:
        raise ConfigError(f"rm.margin=true, but {missing.source} has no 'margin': give every pair of {path} one, or "
                          "set rm.margin=false")
    if not cfg.rm.margin and any(p.margin is not None for p in pairs) and is_main():
        print(f"note: {path} has a 'margin' column, which rm.margin=false leaves unread; set rm.margin=true to use it")


def score_pairs(model: Worker, pairs: list[PairExample], pairs_per_forward: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward model's scores [P] of every pair's chosen and of its rejected answer (no gradient)."""
    samples: list[Sample] = [s for p in pairs for s in p.samples()]
    scores = model.score(samples, score_layout(len(pairs), pairs_per_forward, model.world_size, 2, "pairs")).double()
    return scores[0::2], scores[1::2]


def reward_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Mean and std (population, ddof 0) of the scores over all answers of the given pairs, and per side."""
    both = torch.cat([chosen, rejected])
    return {"mean": float(both.mean()), "std": float(both.std(correction=0)), "n": both.numel(),
            "chosen_mean": float(chosen.mean()), "chosen_std": float(chosen.std(correction=0)),
            "rejected_mean": float(rejected.mean()), "rejected_std": float(rejected.std(correction=0))}


def train_rm(cfg: RMConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "rm",
             final_name: str = "final") -> RMResult:
    if cfg.rm.kind == "process":  # step-labelled rows: a process reward model (imported here: prm.py imports this)
        from exactrl.algorithms.prm import train_prm

        return train_prm(cfg, run_dir, spec, phase, final_name)
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t = cfg.train
    objective = rm_objective(cfg)
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "pairs_train", spec), resolve(eval_data(cfg), "pairs_eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    pairs, note = load_pairs(train_path, tok, cfg.data)  # every row read and checked before the model loads
    held_out, eval_note = load_pairs(eval_path, tok, cfg.data) if eval_path else ([], None)
    held_out = held_out[: cfg.data.eval_size]
    for n in (note, eval_note):
        if n and is_main():
            print(n)
    _check_margins(cfg, pairs, train_path)
    run = prepare_offline(cfg, "rm", phase, run_dir, len(pairs), "pairs", {"train": train_path, "eval": eval_path},
                          tok, None, "reward_model", model_path)
    ctx, model, steps, start, flops, sampler = run.ctx, run.worker, run.steps, run.start, run.flops, run.sampler

    def step(n: int):
        batch: list[Sample] = [s for i in sampler.batch(n - 1) for s in pairs[i].samples()]
        plan = plan_samples(batch, 2 * t.micro_batch_size, t.loss_agg, None, model.world_size, unit=2)
        return batch, model.train_step(batch, plan, objective)

    seconds = run_steps(ctx, model, flops, sampler, steps, start, step, lambda batch, r: {"pairs": len(batch) // 2},
                        lambda r: {"acc": f"{r.metrics.get('reward_accuracy', 0):.2f}"})

    # The final model's scores: statistics over the training pairs, accuracy over the held-out ones.
    stats = {"score_position": "the answer's last real token (its EOS)", "train": reward_stats(
        *score_pairs(model, pairs[: cfg.rm.stats_pairs], t.micro_batch_size)), "train_file": str(train_path)}
    if held_out:
        stats |= {"eval": pairwise_accuracy(*score_pairs(model, held_out, t.micro_batch_size),
                                            [p.kind for p in held_out]), "eval_file": str(eval_path)}
        e = stats["eval"]
        per_kind, lines = pairwise_report(e)
        ctx.write(steps, {"eval_pairwise_accuracy": e["pairwise_accuracy"], "eval_ci95": e["ci95"],
                          "eval_mean_margin": e["mean_margin"]} | per_kind)
        if is_main():
            for line in lines:
                print(f"[{phase}] {line}")
    final = ctx.finish({final_name: model})
    if is_main():  # beside config.json: what a scorer normalises with, (r - mean) / std
        (final / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return RMResult(ctx.run_dir, final, steps, seconds, stats)
