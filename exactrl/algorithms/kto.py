"""`exactrl kto`: a policy trained on unpaired desirable/undesirable rows (KTO), its reference point over the step.

Per optimizer step:
  1. the sampler draws the step's rows (independent of micro-batch size and ranks); the plan lays them out,
     each row a unit of one sample, and counts the step's rows before any backward;
  2. the frozen reference scores every row's completion;
  3. a no-grad pre-pass scores the KL rows (each prompt with the previous row's completion, over the whole
     step) with the policy and the reference, on every rank in the step's micro-batches, gathered: z is the
     mean gap over the step's KL rows, clamped at 0 (kto.z=micro_batch: TRL's per-micro-batch z, to compare);
  4. each micro-batch backpropagates its rows' KTO losses over the step's number of rows (losses/kto.py);
  5. the worker checks every sample was seen once (the canary) and the engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exactrl.algorithms.common import check_data_size, check_world, steps_for
from exactrl.algorithms.offline import run_steps
from exactrl.algorithms.resume import SFTPosition, prepare_resume
from exactrl.algorithms.sft import resolve
from exactrl.compute import FlopsCounter, count_parameters
from exactrl.config.schema_pref import KTOConfig
from exactrl.data.batch import Sample
from exactrl.data.batching import StepSampler
from exactrl.data.preference import load_unpaired
from exactrl.distributed.checkpoint import resume
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import StepPlan, plan_samples
from exactrl.losses.kto import KTOTerm, kl_gaps, micro_batch_z, mismatched, step_z
from exactrl.losses.objective import Objective
from exactrl.models.loading import load_tokenizer
from exactrl.run.context import RunContext
from exactrl.run.evaluation import eval_data, load_eval_set
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
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


def reference_point(policy: Worker, reference: Worker, batch: list[Sample], plan: StepPlan, mode: str = "step"):
    """KTO's z for this step: a float (mode "step": over the step's KL rows, the step's order rotated by one)
    or, for mode "micro_batch", None after setting each row's ``kto_z`` to its micro-batch's (TRL's form).
    Both forwards run without a graph on every rank, in the step's micro-batches, and are gathered."""
    groups = [list(range(len(batch)))] if mode == "step" else [list(mb) for mb in plan.micro_batches]
    kl_rows = mismatched(batch, groups)
    layout = layout_of(plan)
    gaps = kl_gaps(kl_rows, policy.forward(kl_rows, "logprobs", layout), reference.forward(kl_rows, "logprobs",
                                                                                           layout))
    if mode == "step":
        return step_z(gaps)
    for s, z in zip(batch, micro_batch_z(gaps, plan.micro_batches, plan.world_size)):
        s.kto_z = z
    return None


def kto_step(policy: Worker, reference: Worker, batch: list[Sample], plan: StepPlan, objective: Objective,
             mode: str = "step"):
    """One KTO optimizer step over ``batch`` laid out by ``plan`` (unit=1): the reference's log-probs of every
    row, the step's z, then Worker.train_step. Every rank calls it with the same arguments."""
    for s, v in zip(batch, reference.forward(batch, "logprobs", layout_of(plan))):
        s.ref_logprobs = v
    z = reference_point(policy, reference, batch, plan, mode)
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
    steps = steps_for(t, len(rows), t.global_batch_size)
    check_data_size(len(rows), t.global_batch_size, "samples", train_path)
    continues = prepare_resume(cfg, "kto", steps)
    ctx = RunContext(cfg, "kto", phase, run_dir, {"train": train_path, "eval": eval_path}, tok, eval_set, continues)
    where = {"run_dir": ctx.run_dir, "phase": phase, "longest": cfg.data.max_length, "pad_id": tok.pad_token_id}
    policy = Worker.build(cfg, "policy", model_path, total_steps=steps, checkpoint=t.resume_from, **where)
    reference = Worker.build(cfg, "reference", resolve(k.reference, "model", spec) or model_path, policy=policy,
                             **where)
    position = SFTPosition.load(resume(t.resume_from, {"policy": policy}) if t.resume_from else {"step": 0})
    start, flops = position.step, FlopsCounter(count_parameters(policy.model))
    flops.load(position.state())
    sampler = StepSampler(len(rows), t.global_batch_size, t.seed)

    def step(n: int):
        batch: list[Sample] = [rows[i].sample() for i in sampler.batch(n - 1)]
        plan = plan_samples(batch, t.micro_batch_size, t.loss_agg, None, policy.world_size)
        return batch, kto_step(policy, reference, batch, plan, objective, k.z)

    def counts(batch, result) -> dict:
        desirable = sum(s.source == "chosen" for s in batch)
        return {"desirable": desirable, "undesirable": len(batch) - desirable}

    seconds = run_steps(ctx, policy, flops, sampler, steps, start, step, counts,
                        lambda r: {"z": f"{r.metrics.get('kto_z', 0):.3f}"})
    final = ctx.finish({final_name: policy})
    return KTOResult(ctx.run_dir, final, steps, seconds, flops.record())
