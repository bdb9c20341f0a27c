"""`exactrl kto`: a policy trained on unpaired desirable/undesirable rows (KTO), its reference point over the step.

Per optimizer step:
  1. the sampler draws the step's rows (independent of micro-batch size and ranks); the plan lays them out,
     each row a unit of one sample, and counts the step's rows before any backward;
  2. the frozen reference scores every row's completion (or kto.reference_cache=precompute's cache, filled once
     before the first step with every row and KL row the run reads, holds its log-probs);
  3. a no-grad pre-pass scores the KL rows (each prompt with the previous row's completion, over the whole
     step) with the policy and the reference, on every rank in the step's micro-batches, gathered: z is the
     mean gap over the step's KL rows, clamped at 0 (kto.z=micro_batch: TRL's per-micro-batch z, to compare);
  4. each micro-batch backpropagates its rows' KTO losses over the step's number of rows (losses/kto.py);
  5. the worker checks every sample was seen once (the canary) and the engine steps.
At the end: the implicit-reward pairwise accuracy on held-out pairs (data.eval_pairs; beta times each answer's
log-ratio) with its Wilson interval, then the greedy task accuracy (data.eval).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exactrl.algorithms.common import check_world
from exactrl.algorithms.offline import (
    heldout_pairwise,
    load_eval_pairs,
    prepare_offline,
    reference_cache,
    reference_logprobs,
    run_steps,
)
from exactrl.algorithms.sft import resolve
from exactrl.config.schema_pref import KTOConfig
from exactrl.data.batch import Sample
from exactrl.data.preference import load_unpaired
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import StepPlan, plan_samples
from exactrl.losses.kto import KTOTerm, kl_gaps, micro_batch_z, mismatched, step_z
from exactrl.losses.objective import Objective
from exactrl.models.loading import load_tokenizer
from exactrl.run.evaluation import eval_data, load_eval_set
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reference_cache import ReferenceCache
from exactrl.workers.worker import Worker


@dataclass
class KTOResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    compute: dict


def kto_objective(cfg: KTOConfig) -> Objective:
    k = cfg.kto
    return Objective((KTOTerm(beta=k.beta, desirable_weight=k.desirable_weight,
                              undesirable_weight=k.undesirable_weight),))


def layout_of(plan: StepPlan) -> list[list[list[int]]]:
    """Each rank's micro-batches (indices into the step's samples), as Worker.forward takes them."""
    return [[list(mb) for mb in plan.for_rank(r).micro_batches] for r in range(plan.world_size)]


def kl_rows_of(batch: list[Sample], plan: StepPlan, mode: str) -> list[Sample]:
    """The step's KL rows: its rows rotated by one over the whole step (mode "step") or within each micro-batch."""
    return mismatched(batch, [list(range(len(batch)))] if mode == "step" else [list(mb) for mb in plan.micro_batches])


def reference_point(policy: Worker, reference: Worker | None, batch: list[Sample], plan: StepPlan, mode: str = "step",
                    cache: ReferenceCache | None = None):
    """KTO's z for this step: a float (mode "step": over the step's KL rows, the step's order rotated by one)
    or, for mode "micro_batch", None after setting each row's ``kto_z`` to its micro-batch's (TRL's form).
    Both forwards run without a graph on every rank, in the step's micro-batches, and are gathered (the
    reference's read from ``cache`` when given)."""
    kl_rows = kl_rows_of(batch, plan, mode)
    layout = layout_of(plan)
    gaps = kl_gaps(kl_rows, policy.forward(kl_rows, "logprobs", layout),
                   reference_logprobs(cache, reference, kl_rows, layout))
    if mode == "step":
        return step_z(gaps)
    for s, z in zip(batch, micro_batch_z(gaps, plan.micro_batches, plan.world_size)):
        s.kto_z = z
    return None


def kto_step(policy: Worker, reference: Worker | None, batch: list[Sample], plan: StepPlan, objective: Objective,
             mode: str = "step", cache: ReferenceCache | None = None):
    """One KTO optimizer step over ``batch`` laid out by ``plan`` (unit=1): the reference's log-probs of every
    row (from ``cache`` when given), the step's z, then Worker.train_step. Every rank calls it with the same
    arguments."""
    for s, v in zip(batch, reference_logprobs(cache, reference, batch, layout_of(plan))):
        s.ref_logprobs = v
    z = reference_point(policy, reference, batch, plan, mode, cache)
    return policy.train_step(batch, plan, objective.with_term("kto", z=z))


def train_kto(cfg: KTOConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(),
              phase: str = "kto", final_name: str = "final") -> KTOResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t, k = cfg.train, cfg.kto
    objective = kto_objective(cfg)
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "unpaired_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    rows, note = load_unpaired(train_path, tok, cfg.data)  # every row read and checked before the model loads
    if note and is_main():
        print(note)
    eval_set = load_eval_set(cfg, tok, eval_path)
    held_out, pairs_path = load_eval_pairs(cfg, tok, spec)
    run = prepare_offline(cfg, "kto", phase, run_dir, len(rows), "samples", {"train": train_path, "eval": eval_path,
                          "eval_pairs": pairs_path}, tok, eval_set, "policy", model_path)
    ctx, policy, steps, start, flops, sampler, where = (run.ctx, run.worker, run.steps, run.start, run.flops,
                                                        run.sampler, run.where)

    def batch_plan(n: int) -> tuple[list[Sample], StepPlan]:
        batch: list[Sample] = [rows[i].sample() for i in sampler.batch(n - 1)]
        return batch, plan_samples(batch, t.micro_batch_size, t.loss_agg, None, policy.world_size)

    # The reference (LoRA: the policy's model, adapters off), or its log-probs of every row and KL row the run
    # reads, computed once and cached (then the reference model is loaded only when the cache lacks some).
    reference, cache, ref_path = None, None, resolve(k.reference, "model", spec) or model_path

    def build_reference() -> Worker:
        return Worker.build(cfg, "reference", ref_path, policy=policy, **where)

    if k.reference_cache == "precompute":
        needed = [s for n in range(start + 1, steps + 1) for b, plan in [batch_plan(n)]
                  for s in b + kl_rows_of(b, plan, k.z)]
        cache = reference_cache(cfg, k, ref_path, [r.sample() for r in rows],
                                needed + [s for p in held_out for s in p.samples()], build_reference, ctx.run_dir)
    else:
        reference = build_reference()

    def step(n: int):
        batch, plan = batch_plan(n)
        return batch, kto_step(policy, reference, batch, plan, objective, k.z, cache)

    def counts(batch, result) -> dict:
        desirable = sum(s.source == "chosen" for s in batch)
        return {"desirable": desirable, "undesirable": len(batch) - desirable}

    seconds = run_steps(ctx, policy, flops, sampler, steps, start, step, counts,
                        lambda r: {"z": f"{r.metrics.get('kto_z', 0):.3f}"})
    heldout_pairwise(ctx, policy, held_out, lambda x: (k.beta * (x.chosen - x.ref_chosen),
                                                       k.beta * (x.rejected - x.ref_rejected)),
                     lambda samples, layout: reference_logprobs(cache, reference, samples, layout), t.micro_batch_size,
                     steps)
    final = ctx.finish({final_name: policy})
    return KTOResult(ctx.run_dir, final, steps, seconds, flops.record())
