"""Policy-gradient RL from rewards: PPO, GRPO and their relatives, one loop.

``algo.name`` picks an entry of exactrl/algorithms/registry.py: an advantage estimator
(exactrl/advantages), its loss as declared data (an Objective of exactrl/losses/objective.py:
policy surrogate, KL, entropy), whether a critic trains beside the policy, and where rollouts
come from. Per rollout:
  1. draw prompts; each rank samples ``group_size`` responses for its share of them and
     scores them; every rank then holds the whole rollout (exactrl/rollout/collect.py);
  2. old log-probs (and reference log-probs when kl_coef > 0, the critic's values for ppo)
     are computed once, in the micro-batches of the first update, and shared;
  3. advantages over the whole rollout (group baselines, REINFORCE++'s whitening over all
     its tokens, or GAE on the critic's values; the KL in the reward when algo.kl_in_reward);
  4. for each PPO epoch and mini-batch (one optimizer step each): plan the step over all
     ranks, then Worker.train_step backprops each of this rank's micro-batches' exact share of
     the objective and steps; then the critic (ppo) the same way with its own optimizer.
On-policy check: at the first update after a rollout the policy ratio must be exactly 1 (declared
in that step's objective, verified before the step is applied); a deviation means the log-probs
the loss uses are stale or computed differently (the failure mode behind DeepSpeed-Chat's "one
generation batch, one PPO epoch" guidance).
Placement (exactrl/workers/placement.py): the workers and the generator live in this process (under
torchrun, one rank of the run each), or with ray.enabled in Ray actor groups, this process holding
their handles (the engines sample the rollout, this process scores it): the loop reads the same.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from exactrl.algorithms.common import check_data_size, check_world
from exactrl.algorithms.distill import attach_teacher, build_teacher
from exactrl.algorithms.registry import ALGORITHMS, gap_spec
from exactrl.algorithms.resume import RLPosition, prepare_resume
from exactrl.algorithms.rl_advantages import AdaptiveKL, attach_advantages
from exactrl.algorithms.sft import resolve
from exactrl.algorithms.sft_rl import SFTBuffer, relift_sft
from exactrl.audit.manifest import record
from exactrl.checks.on_policy import on_policy_check
from exactrl.checks.rollout_gap import rollout_gap_metrics
from exactrl.checks.trajectory import turn_gaps
from exactrl.checks.weight_sync import SyncCheck
from exactrl.compute import FlopsCounter, count_parameters
from exactrl.config.aggregation import norm_len
from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.data.batching import StepSampler
from exactrl.data.encode import Prompt, load_prompts
from exactrl.data.jsonl import DataError
from exactrl.distributed.checkpoint import resume
from exactrl.distributed.launch import is_main, rank
from exactrl.distributed.step_plan import StepPlan, plan_samples
from exactrl.losses.objective import Objective
from exactrl.models.loading import load_tokenizer
from exactrl.rewards import load_rewards, require_answers
from exactrl.rollout.generator import compares_kept_set
from exactrl.rollout.multiturn import episode_runner
from exactrl.rollout.schedule import RolloutSchedule
from exactrl.run.context import RunContext
from exactrl.run.evaluation import eval_data, load_eval_set, prompt_tools
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.critic import Critic
from exactrl.workers.placement import place
from exactrl.workers.reward_model import model_reward
from exactrl.workers.worker import Worker


@dataclass
class RLResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    generated_tokens: int
    compute: dict  # exactrl/compute.py: FLOPs of the whole phase (a resumed one included)


def require_demonstrations(prompts: list[Prompt], name: str) -> None:
    """A mixed-policy method learns from each prompt's demonstration: refuse a row without one."""
    missing = [p.source for p in prompts if p.demonstration is None]
    if missing:
        raise DataError(f"{missing[0]}: algo.name={name} learns from a demonstration of every prompt, and this row "
                        f"has none ({len(missing)} of {len(prompts)} rows lack one): give each row a "
                        "'demonstration' (or chat 'messages' ending with the assistant's)")


def fragile_settings(cfg: RLConfig) -> list[str]:
    """Settings known to make RL fragile, each with the reason; train_rl warns (never refuses)."""
    a, alg, out = cfg.algo, ALGORITHMS.lookup(cfg.algo.name), []
    updates = a.ppo_epochs * a.mini_batches
    loss = a.policy_loss or alg.policy_loss
    if updates > 1 and a.ratio_check == "off":
        out.append(f"algo.ratio_check=off with {updates} updates per rollout: nothing verifies that the old log-probs "
                   "match the policy that sampled the rollout; stale log-probs are why DeepSpeed-Chat asks for one "
                   "generation batch and one PPO epoch")
    if updates > 1 and loss == "reinforce":
        out.append(f"algo.policy_loss=reinforce with {updates} updates per rollout: the ratio is unclipped, so later "
                   "updates on the same rollout can move the policy without bound (PPO's clip exists for this, "
                   "Schulman et al. 2017)")
    if a.ppo_epochs > 4:
        out.append(f"algo.ppo_epochs={a.ppo_epochs}: every further pass reuses the rollout further off-policy (clip "
                   "fraction and KL grow); LLM recipes (OpenRLHF, verl, TRL) use 1-4")
    if alg.loss_agg and cfg.train.loss_agg != alg.loss_agg:  # dr_grpo: Liu et al. 2025, sec. 3.1
        out.append(f"algo.name={a.name} with train.loss_agg={cfg.train.loss_agg}: Dr.GRPO's fix of GRPO's length bias "
                   f"is the constant-length normaliser {alg.loss_agg} (Liu et al. 2025, sec. 3.1); other modes bring "
                   "the bias back")
    if loss == "gspo" and a.clip_eps > 0.01:
        out.append(f"gspo with algo.clip_eps={a.clip_eps}: a sequence ratio is a geometric mean of token ratios and "
                   "rarely moves that far, so the clip seldom acts; GSPO's paper uses 3e-4 / 4e-4")
    return out


def step_plan(batch: list[Sample], cfg: RLConfig, world_size: int) -> StepPlan:
    """One optimizer step over ``batch`` (all ranks' samples, each its own unit)."""
    t = cfg.train
    return plan_samples(batch, t.micro_batch_size, t.loss_agg, norm_len(cfg),
                        world_size)


def first_pass_micro_batches(samples: list[Sample], cfg: RLConfig, world_size: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (indices into the rollout) of the first epoch, the one in
    which old log-probs are computed and the ratio must be exactly 1."""
    g = len(samples) // cfg.algo.mini_batches  # a step's samples: global_batch_size responses, and any demonstrations
    plans = [(start, step_plan(samples[start : start + g], cfg, world_size)) for start in range(0, len(samples), g)]
    return [[[start + i for i in mb] for start, plan in plans for mb in plan.for_rank(r).micro_batches]
            for r in range(world_size)]


def reuses_first_forward(cfg: RLConfig, samples: list[Sample], stale: bool = False) -> bool:
    """Whether the update's own forward can stand for the old log-probs: the rollout feeds one
    optimizer step, nothing needs them before it (no KL to a reference), the forward runs in
    fp32 as generation does, and the generator recorded what it sampled with, with the weights
    that train on it (not ``stale``: an asynchronous rollout's were an update older)."""
    a = cfg.algo
    # episodes (env.*) compare the trainer's log-probs with the generator's turn by turn: they need the pass
    return (a.ppo_epochs * a.mini_batches == 1 and a.kl_coef == 0 and cfg.model.dtype == "fp32" and not stale
            and not cfg.env.enabled and all(s.gen_logprobs is not None for s in samples))


def mini_batches(samples: list[Sample], cfg: RLConfig, world_size: int,
                 group_rng: random.Random) -> Iterator[tuple[list[Sample], StepPlan, bool]]:
    """(batch, plan, first) per optimizer step of one rollout: PPO epochs x mini-batches of
    train.global_batch_size responses; ``first`` marks the update whose micro-batches the old
    log-probs were computed in. Later epochs reshuffle whole groups, never splitting one
    across optimizer steps."""
    a, g = cfg.algo, len(samples) // cfg.algo.mini_batches  # as first_pass_micro_batches
    groups = [samples[i : i + a.group_size] for i in range(0, len(samples), a.group_size)]
    for epoch in range(a.ppo_epochs):
        if epoch > 0:
            group_rng.shuffle(groups)
        order = [s for group in groups for s in group]
        for start in range(0, len(order), g):
            batch = order[start : start + g]
            yield batch, step_plan(batch, cfg, world_size), epoch == 0 and start == 0


def attach_fields(samples: list[Sample], cfg: RLConfig, policy: Worker, reference: Worker | None,
                  critic: Critic | None, kept: bool = False, stale: bool = False) -> bool:
    """The per-token fields fixed for the rollout (old log-probs -- also over the top-p/top-k
    kept set when ``kept``, from the same forward --, reference log-probs, the critic's values),
    each computed once in the first update's micro-batches and shared by every rank. Returns
    whether the old-log-prob pass was skipped (the update's own forward stands for it)."""
    first_pass = first_pass_micro_batches(samples, cfg, policy.world_size)
    reused = reuses_first_forward(cfg, samples, stale)
    old = {"logprobs": "old_logprobs", **({"kept_logprobs": "old_kept_logprobs"} if kept else {})}
    for worker, fields in ((None if reused else policy, old), (reference, {"logprobs": "ref_logprobs"}),
                           (critic, {"values": "old_values"})):
        if worker is not None:
            for name, values in worker.forward_fields(samples, tuple(fields), first_pass).items():
                for s, v in zip(samples, values):
                    setattr(s, fields[name], v)
    return reused


def update(policy: Worker | None, critic: Critic | None, batch: list[Sample], plan: StepPlan,
           objective: Objective) -> tuple[float, dict]:
    """One optimizer step of the policy (None: the critic's warm-up) then, with a critic, one of it,
    on the same mini-batch and plan. Returns the policy's loss and the step's stats."""
    stats = {"responses": sum(s.source == "on_policy" for s in batch), "loss_tokens": plan.normalizer.num_tokens,
             "ratio_dev_first": None}
    loss = 0.0
    if policy is not None:
        result = policy.train_step(batch, plan, objective)
        # None: no term took a ratio (srft), no on-policy sample (hpt)
        ratio_dev = result.metrics.pop("ratio_dev", None)
        if objective.on_policy is not None:
            stats["ratio_dev_first"] = ratio_dev
        loss, stats = result.loss, stats | result.metrics | result.stats
    if critic is not None:
        stats |= critic.step(batch, plan)
    return loss, stats


def train_rl(cfg: RLConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "rl",
             model_path: str | None = None, final_name: str = "final") -> RLResult:
    check_world(cfg)
    # the same on every rank: each response draws from its own keyed stream (rollout/collect.py)
    seed_everything(cfg.train.seed)
    for message in fragile_settings(cfg) if rank() == 0 else []:
        warnings.warn(message, UserWarning, stacklevel=2)
    a, t, alg = cfg.algo, cfg.train, ALGORITHMS.lookup(cfg.algo.name)
    # the policy's loss as data; refuses a KL that would land nowhere before anything loads
    objective = alg.objective(cfg)
    # only a policy term takes a ratio to check (srft's terms are likelihoods, its demonstrations' ratio p)
    has_ratio = any(term.kind == "policy" for term in objective.terms)
    model_path = model_path or resolve(cfg.model.path, "model", spec)
    train_kind = "mixed_train" if alg.demonstrations else "rl_train"
    train_path, eval_path = resolve(cfg.data.train, train_kind, spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    prompts, note = load_prompts(train_path, tok, cfg.data, tools=prompt_tools(cfg))
    if note and is_main():
        print(note)
    if alg.demonstrations:
        require_demonstrations(prompts, a.name)
    # One reward process for the whole run (exactrl/rewards/worker.py), evaluation included.
    reward_fns = load_rewards(cfg.reward.specs(), cfg.reward.weights, cfg.reward.timeout, cfg.reward.retries,
                              cfg.eval.reward_fn)
    require_answers(prompts, reward_fns, "reward.fn")
    reward_fns.model = model_reward(cfg.reward, tok, t.micro_batch_size, cfg.model.trust_remote_code)
    if cfg.env.enabled:  # multi-turn episodes: their environments, and the template checked to extend append-only
        reward_fns.episodes = episode_runner(cfg.env, tok, say=print if is_main() else None)
    eval_set = load_eval_set(cfg, tok, eval_path, reward_fns.eval)
    if eval_set is not None:
        eval_set.episodes = reward_fns.episodes
    steps_per_rollout = a.ppo_epochs * a.mini_batches
    prompts_per_rollout = t.global_batch_size * a.mini_batches // a.group_size
    rollouts = math.ceil(t.max_steps / steps_per_rollout) if t.max_steps else max(1, math.ceil(t.epochs * len(
        prompts) / prompts_per_rollout))
    steps = rollouts * steps_per_rollout
    check_data_size(len(prompts), prompts_per_rollout, "prompts", train_path)
    continues = prepare_resume(cfg, "rl", steps)
    ctx = RunContext(cfg, "rl", phase, run_dir, {"train": train_path, "eval": eval_path}, tok, eval_set, continues)

    # The workers: the policy, the frozen reference (a KL term needs one), the critic (ppo), in this process or as
    # Ray actor groups (ray.enabled): the loop reads the same. With LoRA the reference is the policy's own model with
    # its adapters off: no second copy.
    # the longest row a forward sees (start-up self-checks test up to it): an episode's turns and observations too
    longest = cfg.data.max_length + cfg.rollout.max_new_tokens + (cfg.env.max_tokens if cfg.env.enabled else 0)
    pad = tok.pad_token_id
    where = {"run_dir": ctx.run_dir, "phase": phase, "longest": longest, "pad_id": pad}
    warmup = min(cfg.critic.warmup_rollouts, rollouts) * steps_per_rollout if alg.critic else 0
    roles, schedule, teacher = place(cfg, ctx.run_dir, phase), None, None
    try:
        # the policy's schedule starts after the critic's warm-up
        policy = roles.worker("policy", model_path, total_steps=max(1, steps - warmup), checkpoint=t.resume_from,
                              **where)
        reference = roles.worker("reference", model_path, policy=policy, **where) if a.kl_coef > 0 else None
        critic = roles.worker("critic", cfg.critic.path or model_path, total_steps=steps, checkpoint=t.resume_from,
                              **where) if alg.critic else None
        if reward_fns.model is not None:  # reward.model, frozen: scores each rollout once every rank holds all of it
            reward_fns.model.worker = roles.worker("reward", cfg.reward.model, **where)
        teacher = build_teacher(roles, cfg, tok, spec, where)  # distill.teacher: frozen, scores each rollout once
        generator = roles.generator(policy, tok)
        sync_check = SyncCheck(cfg.rollout.sync_check, cfg.model.dtype, cfg.rollout.probe_tol)
        # the rollout-trainer gap, compared in the generator's convention (over the kept set if its log-probs are)
        kept = compares_kept_set(generator, cfg.rollout.top_p, cfg.rollout.top_k)
        gap = gap_spec(cfg, kept)
        if is_main():  # `exactrl audit run` reports it (exactrl/audit/recorded.py)
            record(ctx.run_dir, "rollout_correction", phase, gap.record(type(generator).__name__,
                                                                        generator.logprobs_over))

        sampler = StepSampler(len(prompts), prompts_per_rollout, t.seed)
        group_rng = random.Random(f"{t.seed}-minibatches")
        kl_control = AdaptiveKL(a.kl_coef, a.kl_target, a.kl_horizon)
        buffer = SFTBuffer(a.relift.buffer_size) if alg.sft_buffer else None
        first_rollout, flops = 0, FlopsCounter(policy.apply(count_parameters))
        if t.resume_from:
            saved = {"policy": policy, "critic": critic} if critic else {"policy": policy}
            position = RLPosition.load(resume(t.resume_from, saved))
            first_rollout = position.rollout + 1
            group_rng.setstate(position.group_rng)
            if position.kl_coef is not None:  # None: a checkpoint from before the controller's coefficient was kept
                kl_control.coef = position.kl_coef
            if buffer is not None:
                buffer.pending = position.sft_buffer
            flops.load(position.state())
        # After the resume: FSDP2 leaves a forward-only call's root parameters unsharded, which a
        # sharded optimizer state cannot be loaded against.
        policy.check_generation(cfg, tok, ctx.run_dir, phase, sampled=True)

        r = cfg.ray
        schedule = RolloutSchedule(policy, generator, sync_check, lambda n: alg.rollout(
            generator, prompts, sampler.batch(n), n, reward_fns, cfg), r.max_staleness if r.async_rollouts else None,
            overlap=r.enabled)
        gen_tokens, t0, step = 0, time.perf_counter(), first_rollout * steps_per_rollout
        ctx.start(steps, step)
        for rollout in range(first_rollout, rollouts):
            # 1. a rollout sampled and scored with the weights its schedule pushed (verified: digest, probe, weights
            # state): the policy's current ones, or asynchronously the ones before its last update
            samples, rstats, gen_seconds = schedule.take(rollout, rollouts)
            gen_tokens += rstats["generated_tokens"]
            # dynamic sampling (refill rounds) generated more responses than it kept: those count as generated too
            flops.generated(samples, rstats["generated_tokens"] if "refill_rounds" in rstats else None)

            # 2. per-token fields fixed for the rollout, computed in the first update's micro-batches
            reused = attach_fields(samples, cfg, policy, reference, critic, kept, stale=rstats["staleness"] > 0)
            attach_teacher(samples, teacher, first_pass_micro_batches(samples, cfg, policy.world_size), cfg.distill)
            if not reused:  # else the update's forward measures it (checks/rollout_gap.py)
                rstats |= rollout_gap_metrics(samples, gap) | turn_gaps(samples)

            # 3. advantages over the whole rollout, under this rollout's KL coefficient (the controller moves it for
            # the next)
            kl_coef = kl_control.coef
            if reference is not None:
                rstats["rollout_kl"], rstats["kl_coef"] = kl_control.update(samples), kl_coef
            attach_advantages(samples, cfg, kl_coef)

            # 4. epochs x mini-batches, one verified optimizer step each (during the critic's warm-up only the critic
            # steps)
            loss_now = objective.with_term("kl", coef=kl_coef).with_term(
                "policy", old="self" if reused else "old_logprobs").with_gap(gap, measure=reused)
            train_policy = critic is None or rollout >= cfg.critic.warmup_rollouts
            for batch, plan, first in mini_batches(samples, cfg, policy.world_size, group_rng):
                # the first update must see ratio 1 on every rank, checked before it is applied
                check = on_policy_check(cfg, rollout, against_generator=reused) if first and has_ratio and any(
                    s.source == "on_policy" for s in batch) else None
                loss, stats = update(policy if train_policy else None, critic, batch, plan, replace(
                    loss_now, on_policy=check))
                step += 1
                if train_policy:
                    flops.trained(batch)
                if buffer is not None and step % steps_per_rollout == 0:  # after the rollout's last GRPO step (ReLIFT)
                    sft_stats, demos = relift_sft(policy, buffer, samples, sampler.batch(rollout), prompts, cfg)
                    stats |= sft_stats
                    flops.trained(demos)

                # 5. log, evaluate, checkpoint
                if ctx.logs(step):
                    ctx.write(step, {"rollout": rollout, "loss": loss, **stats, **rstats,
                                     "gen_tokens_per_s": rstats["generated_tokens"] / gen_seconds, **flops.record(),
                                     "wall_seconds": time.perf_counter() - t0})
                ctx.step_done(step, {"policy": policy, "critic": critic},
                              RLPosition(step=step, rollout=rollout, group_rng=group_rng.getstate(),
                                         kl_coef=kl_control.coef, sft_buffer=buffer and buffer.pending,
                                         **flops.state()).state(),
                              {"reward": f"{rstats['reward_mean']:.3f}"})
        seconds = time.perf_counter() - t0
        getattr(generator, "close", lambda: None)()  # a vLLM engine's memory back before the final save and eval
        final = ctx.finish({final_name: policy, f"{final_name}-critic": critic})
    finally:
        if schedule is not None:
            schedule.close()
        roles.close()
        getattr(teacher, "close", lambda: None)()  # a vLLM teacher's engine process (distill.teacher_engine=vllm)
        reward_fns.close()
    return RLResult(ctx.run_dir, final, steps, seconds, gen_tokens, flops.record())
