"""`exactrl dpo`: a policy trained on preference pairs (the DPO family), exact per pair.

Per optimizer step:
  1. the sampler draws the step's pairs (independent of micro-batch size and ranks);
  2. the step plan keeps each pair's two sequences together (unit=2) and counts the step's pairs
     and chosen tokens before any backward;
  3. the frozen reference scores both sequences of every pair (reference-free losses skip it), or they are read
     from dpo.reference_cache=precompute's cache, filled once before the first step (workers/reference_cache.py);
  4. each micro-batch backpropagates its pairs' losses over the step's number of pairs
     (losses/pairs.py), plus an NLL on the chosen answers over the step's chosen tokens when asked;
  5. the worker checks every sample was seen once (the canary) and the engine steps.
At the end: the implicit-reward pairwise accuracy on held-out pairs (data.eval_pairs; the loss's own chosen and
rejected rewards, beta log-ratios for dpo) with its Wilson interval, then the greedy task accuracy (data.eval).
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
from exactrl.config.loader import ConfigError
from exactrl.config.schema_pref import DPOConfig
from exactrl.data.batch import Sample
from exactrl.data.preference import load_pairs
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import NLLTerm, Objective
from exactrl.losses.pairs import PairTerm
from exactrl.losses.preference import PAIR_LOSSES, PairParams
from exactrl.models.loading import load_tokenizer
from exactrl.run.evaluation import eval_data, load_eval_set
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.worker import Worker

KNOBS = ("beta", "label_smoothing", "gamma", "ipo_length_normalized", "orpo_lambda")


@dataclass
class DPOResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    compute: dict


def dpo_objective(cfg: DPOConfig) -> Objective:
    """The pair term of dpo.loss, and the NLL on the chosen answers when dpo.nll_coef (orpo: 1) is set."""
    d = cfg.dpo
    unused = [k for k in KNOBS if k not in PAIR_LOSSES[d.loss].uses and getattr(d, k) != DPOConfig().dpo.__dict__[k]]
    if unused:
        raise ConfigError(f"dpo.{unused[0]} is set, but dpo.loss={d.loss} does not read it (it reads "
                          f"{', '.join('dpo.' + k for k in PAIR_LOSSES[d.loss].uses) or 'none of them'}); unset it")
    terms = [PairTerm(loss=d.loss, params=PairParams(**{k: getattr(d, k) for k in KNOBS}))]
    if d.nll() > 0:
        terms.append(NLLTerm(sources=("chosen",), coef=d.nll(), agg=cfg.train.loss_agg))
    return Objective(tuple(terms))


def train_dpo(cfg: DPOConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(),
              phase: str = "dpo", final_name: str = "final") -> DPOResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t, d = cfg.train, cfg.dpo
    objective = dpo_objective(cfg)
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "pairs_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    pairs, note = load_pairs(train_path, tok, cfg.data)  # every row read and checked before the model loads
    if note and is_main():
        print(note)
    eval_set = load_eval_set(cfg, tok, eval_path)
    held_out, pairs_path = load_eval_pairs(cfg, tok, spec)
    run = prepare_offline(cfg, "dpo", phase, run_dir, len(pairs), "pairs", {"train": train_path, "eval": eval_path,
                          "eval_pairs": pairs_path}, tok, eval_set, "policy", model_path)
    ctx, policy, steps, start, flops, sampler, where = (run.ctx, run.worker, run.steps, run.start, run.flops,
                                                        run.sampler, run.where)

    # The reference (LoRA: the policy's model, adapters off), or its log-probs of every sequence the run reads,
    # computed once and cached (then the reference model is loaded only when the cache lacks some).
    needs_reference, reference, cache = PAIR_LOSSES[d.loss].needs_reference, None, None
    ref_path = resolve(d.reference, "model", spec) or model_path

    def build_reference() -> Worker:
        return Worker.build(cfg, "reference", ref_path, policy=policy, **where)

    if needs_reference and d.reference_cache == "precompute":
        needed = [s for n in range(start + 1, steps + 1) for i in sampler.batch(n - 1) for s in pairs[i].samples()]
        cache = reference_cache(cfg, d, ref_path, [s for p in pairs for s in p.samples()],
                                needed + [s for p in held_out for s in p.samples()], build_reference, ctx.run_dir)
    elif needs_reference:
        reference = build_reference()

    def step(n: int):
        batch: list[Sample] = [s for i in sampler.batch(n - 1) for s in pairs[i].samples()]
        plan = plan_samples(batch, 2 * t.micro_batch_size, t.loss_agg, None, policy.world_size, unit=2)
        if needs_reference:  # the reference's log-probs of both answers, in the step's own micro-batches
            layout = [[list(mb) for mb in plan.for_rank(r).micro_batches] for r in range(policy.world_size)]
            for s, v in zip(batch, reference_logprobs(cache, reference, batch, layout)):
                s.ref_logprobs = v
        return batch, policy.train_step(batch, plan, objective)

    seconds = run_steps(ctx, policy, flops, sampler, steps, start, step, lambda batch, r: {"pairs": len(batch) // 2},
                        lambda r: {"acc": f"{r.metrics.get('reward_accuracy', 0):.2f}"})
    term = objective.terms[0]

    def rewards(x):  # the loss's own implicit rewards (dpo: beta times each answer's log-ratio)
        extra = PAIR_LOSSES[d.loss].fn(x, term.params)[1]
        return extra["chosen_reward"], extra["rejected_reward"]

    heldout_pairwise(ctx, policy, held_out, rewards, (lambda samples, layout: reference_logprobs(
        cache, reference, samples, layout)) if needs_reference else None, t.micro_batch_size, steps)
    final = ctx.finish({final_name: policy})
    return DPOResult(ctx.run_dir, final, steps, seconds, flops.record())
