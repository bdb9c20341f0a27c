"""`exactrl kd`: offline knowledge distillation. A student trained on SFT data (the rows `exactrl sft` reads) with
(1 - kd.alpha) NLL + kd.alpha D(p_T, p_S) at every loss token, D a divergence to a frozen teacher's next-token
distribution (exactrl/losses/kd.py), exact per step.

Per optimizer step:
  1. the sampler draws the step's samples (independent of micro-batch size and ranks);
  2. the step plan counts their loss tokens and fixes the one normaliser before any backward;
  3. the teacher scores the step's samples in the step's own micro-batches, without a graph: its logits at every
     target (the top-k log-probs and ids for kd.loss=topk_forward_kl), kept on the CPU for this step only;
  4. each micro-batch backpropagates its exact share: the NLL and the divergence of its loss tokens over the
     step's normaliser;
  5. the worker checks every sample was seen once (the canary) and the engine steps.
The teacher reads the student's token ids as they are, so the two must share a tokenizer and a vocabulary
size (refused otherwise, before training). Greedy accuracy on data.eval: the teacher's and the student's before
the first step, the student's at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exactrl.algorithms.common import check_world
from exactrl.algorithms.offline import prepare_offline, run_steps
from exactrl.algorithms.sft import demonstration, resolve
from exactrl.compute import count_parameters
from exactrl.config.aggregation import norm_len as loss_agg_norm
from exactrl.config.loader import ConfigError
from exactrl.config.schema_kd import KDConfig
from exactrl.data.batch import Sample
from exactrl.data.encode import load_sft
from exactrl.device import process_device
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import StepPlan, plan_samples
from exactrl.dtypes import autocast_for
from exactrl.losses.kd import TEACHER_FIELDS, kd_objective
from exactrl.losses.objective import Objective
from exactrl.models.loading import load_tokenizer, tokenizer_mismatch
from exactrl.rollout.hf import base_model
from exactrl.run.evaluation import eval_data, greedy_accuracy, load_eval_set
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.load import check_generator, load_model
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import StepResult, Worker


@dataclass
class KDResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    compute: dict


def check_teacher(cfg: KDConfig, tokenizer, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's: the same ids would mean other tokens."""
    teacher_tok = load_tokenizer(teacher_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    differs = tokenizer_mismatch(tokenizer, teacher_tok)
    if differs:
        raise ConfigError(f"kd.teacher={cfg.kd.teacher}: its tokenizer is not the student's ({differs}); distillation "
                          "compares the two models' distributions over the same token ids, so give a teacher of the "
                          "student's tokenizer")


def check_vocabularies(cfg: KDConfig, student: Worker, teacher: Worker) -> None:
    """Same tokenizer, but an embedding padded to another size (Qwen's) gives logits of another width."""
    a, b = base_model(student.model).config.vocab_size, base_model(teacher.model).config.vocab_size
    if a != b:
        raise ConfigError(f"kd.teacher={cfg.kd.teacher}: its vocabulary has {b} logits, the student's "
                          f"({cfg.model.path}) {a}; the divergence compares distributions over the same vocabulary")


def build_teacher(cfg: KDConfig, path: str, where: dict) -> Teacher:
    """The frozen teacher worker (a model of its own, also under LoRA), giving kd.loss's fields at kd.temperature,
    run as the reference is (the run's autocast and log-prob chunks). Built here rather than by Worker.build's role
    table: that one reads `exactrl rl`'s rollout and distill sections, which `exactrl kd` has not."""
    device, dtype = process_device(), cfg.model.dtype
    model = load_model(cfg, path, where["run_dir"], where["phase"], "teacher", where["longest"], trainable=False)
    teacher = Teacher("teacher", model, pad_id=where["pad_id"], packed=cfg.train.padding_free,
                      temperature=cfg.kd.temperature, logprob_chunk=cfg.train.logprob_chunk_size,
                      autocast=lambda: autocast_for(dtype, device))
    teacher.topk = cfg.kd.top_k
    return teacher


def kd_step(policy: Worker, teacher: Teacher, batch: list[Sample], plan: StepPlan, objective: Objective,
            fields: tuple[str, ...]) -> StepResult:
    """One optimizer step: the teacher's ``fields`` of the step's samples, computed in the step's own micro-batches
    (every rank's, shared as the reference's log-probs are) and set on the samples for this step only, then the
    policy's verified step."""
    layout = [[list(mb) for mb in plan.for_rank(r).micro_batches] for r in range(policy.world_size)]
    for name, values in teacher.forward_fields(batch, fields, layout).items():
        for s, v in zip(batch, values):
            setattr(s, f"teacher_{name}", v)
    try:
        return policy.train_step(batch, plan, objective)
    finally:  # [targets x vocabulary] per sample: never kept past its step
        for s in batch:
            for name in fields:
                setattr(s, f"teacher_{name}", None)


def train_kd(cfg: KDConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "kd",
             final_name: str = "final") -> KDResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t, k = cfg.train, cfg.kd
    model_path, teacher_path = resolve(cfg.model.path, "model", spec), resolve(k.teacher, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "sft_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    check_teacher(cfg, tok, teacher_path)
    examples, note = load_sft(train_path, tok, cfg.data)  # every row read and checked before a model loads
    if note and is_main():
        print(note)
    eval_set = load_eval_set(cfg, tok, eval_path)
    run = prepare_offline(cfg, "kd", phase, run_dir, len(examples), "samples", {"train": train_path,
                          "eval": eval_path}, tok, eval_set, "policy", model_path)
    ctx, policy, steps, start, flops, sampler = run.ctx, run.worker, run.steps, run.start, run.flops, run.sampler
    teacher = build_teacher(cfg, teacher_path, run.where)
    check_vocabularies(cfg, policy, teacher)
    flops.teacher_params = count_parameters(teacher.model)  # its forward over every trained token: 2*N_teacher*D
    if eval_set is not None:
        check_generator(cfg, policy.model, tok, ctx.run_dir, phase, sampled=False,
                        synced=policy.engine.synced_decoding)
        if start == 0:  # where the student starts, and what it is distilled from
            acc = greedy_accuracy(cfg, teacher, tok, eval_set)
            ctx.write(0, {"teacher_eval_accuracy": acc.value, "teacher_eval_ci95": list(acc.ci95)})
            if is_main():
                print(f"[{phase}] teacher: greedy accuracy on {acc.n} eval prompts {acc}")
            ctx.evaluate(0, policy)
    norm_len = loss_agg_norm(cfg)
    objective = kd_objective(k.loss, k.alpha, temperature=k.temperature, beta=k.beta, agg=t.loss_agg,
                             norm_len=norm_len)
    samples, fields = [demonstration(e) for e in examples], TEACHER_FIELDS[k.loss]

    def step(n: int):
        batch: list[Sample] = [samples[i] for i in sampler.batch(n - 1)]
        plan = plan_samples(batch, t.micro_batch_size, t.loss_agg, norm_len, policy.world_size, sort=True)
        return batch, kd_step(policy, teacher, batch, plan, objective, fields)

    seconds = run_steps(ctx, policy, flops, sampler, steps, start, step,
                        lambda batch, r: {"loss_tokens": sum(s.loss_tokens for s in batch)},
                        lambda r: {"kd": f"{r.metrics.get('kd_divergence', 0):.4f}"})
    final = ctx.finish({final_name: policy})
    return KDResult(ctx.run_dir, final, steps, seconds, flops.record())
