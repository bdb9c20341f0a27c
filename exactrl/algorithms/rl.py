"""Policy-gradient RL from outcome rewards: GRPO and its relatives, one loop.

``algo.name`` picks an advantage estimator (exactrl/advantages) and a policy loss
(exactrl/losses/policy.py) from ALGORITHMS below; everything else is shared. Per rollout:
  1. draw prompts; sample ``group_size`` responses each with the rollout engine; score them;
  2. the trainer recomputes old log-probs (and reference log-probs when kl_coef > 0) once,
     in the same micro-batches it will train on;
  3. advantages over the whole rollout (group baselines, or REINFORCE++'s whitening over all
     its tokens, with the KL in the reward when algo.kl_in_reward);
  4. for each PPO epoch and mini-batch (one optimizer step each): plan the step, backprop
     each micro-batch's exact share of the policy loss, step.
On-policy check: at the first update after a rollout the policy ratio must be exactly 1; a
deviation means the log-probs the loss uses are stale or computed differently (the failure
mode behind DeepSpeed-Chat's "one generation batch, one PPO epoch" guidance).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from exactrl.advantages import AdvantageInput, get_advantage
from exactrl.algorithms.common import after_step, check_world, finish, load_eval_prompts, open_run, progress, seed_everything
from exactrl.config.schema import RLConfig
from exactrl.data.batching import StepSampler, collate_rl, pad_right
from exactrl.data.encode import encode_prompts
from exactrl.data.jsonl import read_jsonl
from exactrl.distributed.checkpoint import check_resumable, resume
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses import aggregate, canary_share, masked_mean
from exactrl.losses.policy import PolicyInput, get_policy_loss
from exactrl.losses.token_losses import kl_penalty, token_entropy, token_logprobs
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.rewards import load_rewards, score_all
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.builtin import BuiltinSpec, resolve


# algo.name -> (advantage estimator, policy loss), with the paper each comes from.
ALGORITHMS = {
    "grpo": ("grpo", "ppo"),  # Shao et al. 2024, arXiv 2402.03300
    "dr_grpo": ("dr_grpo", "ppo"),  # Liu et al. 2025, arXiv 2503.20783 (with train.loss_agg=seq-mean-token-sum-norm)
    "rloo": ("rloo", "ppo"),  # Ahmadian et al. 2024, arXiv 2402.14740
    "reinforce_pp": ("reinforce_pp", "ppo"),  # Hu 2025, arXiv 2501.03262
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo"),  # ibid.
    "gspo": ("grpo", "gspo"),  # Zheng et al. 2025, arXiv 2507.18071
    "dapo": ("grpo", "ppo"),  # Yu et al. 2025, arXiv 2503.14476 (+ clip_eps_high, dynamic sampling, overlong shaping)
}


class RolloutError(RuntimeError):
    """A rollout could not be filled (DAPO's dynamic sampling ran out of refill rounds)."""


@dataclass
class AdaptiveKL:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2; TRL's
    AdaptiveKLController): after each rollout, coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon,
    with KL the rollout's mean per-response sum of log p_old - log p_ref and n its responses.
    Without a target the coefficient stays fixed."""

    coef: float
    target: float | None
    horizon: int

    def update(self, samples: list[Sample]) -> float:
        """The coefficient for this rollout; moves it for the next one. Returns the measured KL."""
        kl = sum(float((s.old_logprobs - s.ref_logprobs)[len(s.prompt_ids) - 1 :].sum()) for s in samples) / len(samples)
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * len(samples) / self.horizon
        return kl


class OnPolicyCheckError(RuntimeError):
    """The policy ratio was not 1 at the first update after a rollout."""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    advantages: torch.Tensor | None = None  # [len(seq) - 1], zero on prompt targets
    old_logprobs: torch.Tensor | None = None  # [len(seq) - 1], fixed for the whole rollout
    ref_logprobs: torch.Tensor | None = None


@dataclass
class RLResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    generated_tokens: int


def collect_rollout(engine_gen: HFEngine, prompts, rewards_cfg, cfg: RLConfig) -> tuple[list[Sample], dict]:
    r = cfg.rollout
    gens = engine_gen.generate([p.input_ids for p in prompts], n=cfg.algo.group_size, temperature=r.temperature,
                               top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    src = [prompts[g.prompt_index] for g in gens]
    failures: list = []
    rewards, parts = score_all(rewards_cfg, [p.text for p in src], [g.text for g in gens], [p.answer for p in src],
                               [p.source for p in src], cfg.reward.timeout, cfg.reward.fallback, failures)
    components = {f"reward/{spec}": sum(v) / len(v) for spec, v in parts.items()} if len(parts) > 1 else {}
    overlong = [overlong_penalty(len(g.response_ids), r.max_new_tokens, cfg.algo.overlong_buffer, cfg.algo.overlong_penalty)
                for g in gens]
    rewards = [rw + pen for rw, pen in zip(rewards, overlong)]
    samples = [Sample(g.prompt_ids, g.response_ids, rw) for g, rw in zip(gens, rewards)]
    rw, main = torch.tensor(rewards), torch.tensor(next(iter(parts.values())))
    if cfg.algo.overlong_buffer:
        components["overlong_penalty"] = sum(overlong) / len(overlong)
    stats = {"reward_mean": rw.mean().item(), "reward_std": rw.std().item(), "accuracy": (main >= 1.0).float().mean().item(), **components,
             "response_length": sum(len(g.response_ids) for g in gens) / len(gens),
             "finished": sum(g.finished for g in gens) / len(gens), "reward_failures": len(failures), "generated_tokens": sum(len(g.response_ids) for g in gens)}
    return samples, stats


def overlong_penalty(length: int, max_length: int, buffer: int, weight: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to max_length - buffer,
    then falling linearly to -weight at max_length (a response cut off there scores -weight)."""
    if buffer <= 0 or length <= max_length - buffer:
        return 0.0
    return -weight * min(1.0, (length - (max_length - buffer)) / buffer)


def collect_dynamic_rollout(engine_gen: HFEngine, prompts, indices: list[int], rollout: int, rewards_cfg,
                            cfg: RLConfig) -> tuple[list[Sample], dict]:
    """DAPO's dynamic sampling: groups whose responses all got the same reward carry no signal
    (zero advantage) and are dropped; fresh prompts (a deterministic draw per rollout and round,
    so resumed runs draw the same) are sampled until the rollout holds as many groups as asked."""
    want, g = len(indices), cfg.algo.group_size
    rng = random.Random(f"{cfg.train.seed}-refill-{rollout}")
    kept, dropped, stats = [], 0, None
    for rounds in range(cfg.algo.max_refill_rounds + 1):
        samples, st = collect_rollout(engine_gen, [prompts[i] for i in indices], rewards_cfg, cfg)
        if stats is None:
            stats = st
        else:
            stats["generated_tokens"] += st["generated_tokens"]
        for start in range(0, len(samples), g):
            group = samples[start : start + g]
            if len({s.reward for s in group}) > 1:
                kept.append(group)
            else:
                dropped += 1
        if len(kept) >= want:
            stats.update(groups_dropped=dropped, refill_rounds=rounds)
            return [s for group in kept[:want] for s in group], stats
        indices = rng.sample(range(len(prompts)), want)
    raise RolloutError(f"dynamic sampling kept {len(kept)} of {want} groups after algo.max_refill_rounds="
                       f"{cfg.algo.max_refill_rounds} refills ({dropped} groups had all-equal rewards); raise it, or the "
                       "task is too easy or too hard for the policy")


@torch.no_grad()
def attach_logprobs(model, samples: list[Sample], attr: str, micro_batch_size: int, pad_id: int, temperature: float, autocast):
    """Store each sample's per-token log-probs, computed in the micro-batches training will use."""
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        b = collate_rl(chunk, pad_id)
        with autocast():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lp = token_logprobs(logits, b["input_ids"], temperature)
        for s, row in zip(chunk, lp):
            setattr(s, attr, row[: len(s.prompt_ids) + len(s.response_ids) - 1].clone())


def attach_advantages(samples: list[Sample], cfg: RLConfig, kl_coef: float | None = None) -> None:
    """Per-token advantages from the whole rollout (its groups are consecutive samples).
    ``kl_coef``: this rollout's coefficient (adaptive KL), else algo.kl_coef."""
    a = cfg.algo
    kl_coef = a.kl_coef if kl_coef is None else kl_coef
    mask = pad_right([[0] * (len(s.prompt_ids) - 1) + [1] * len(s.response_ids) for s in samples], 0).to(torch.float64)
    token_rewards = None
    if a.kl_coef > 0 and a.kl_in_reward:  # -beta * KL(old policy || reference) per token, k1
        kl = [kl_penalty(s.old_logprobs.double(), s.ref_logprobs.double(), "k1") for s in samples]
        token_rewards = -kl_coef * torch.nn.utils.rnn.pad_sequence(kl, batch_first=True)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv, _ = get_advantage(ALGORITHMS[a.name][0])(AdvantageInput(rewards, mask, a.group_size, token_rewards,
                                                                 gamma=a.gamma, std_normalize=a.std_normalize))
    for s, row in zip(samples, adv):
        s.advantages = row[: len(s.prompt_ids) + len(s.response_ids) - 1].float()


def policy_micro_batch_loss(model, engine, samples: list[Sample], normalizer, cfg: RLConfig, pad_id: int,
                            kl_coef: float | None = None):
    """This micro-batch's part of the step loss, its canary share, and its metrics."""
    b = collate_rl(samples, pad_id)
    with engine.autocast():
        logits = engine.forward(model, input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    logp = token_logprobs(logits, b["input_ids"], cfg.rollout.temperature)
    mask = b["loss_mask"]
    a = cfg.algo
    tok_loss, ratio, clipped = get_policy_loss(ALGORITHMS[a.name][1])(
        PolicyInput(logp, b["old_logprobs"], b["advantages"], mask, a.clip_eps, a.clip_eps_high or a.clip_eps))
    m = {}
    if a.kl_coef > 0 and not a.kl_in_reward:
        kl = kl_penalty(logp, b["ref_logprobs"], a.kl_estimator)
        tok_loss = tok_loss + (a.kl_coef if kl_coef is None else kl_coef) * kl
        m["kl"] = masked_mean(kl.detach(), mask).item()
    with torch.set_grad_enabled(a.entropy_coef > 0 and torch.is_grad_enabled()):
        entropy = token_entropy(logits, cfg.rollout.temperature)
    if a.entropy_coef > 0:  # a bonus: higher entropy lowers the loss
        tok_loss = tok_loss - a.entropy_coef * entropy
    with torch.no_grad():
        m["clip_frac"] = masked_mean(clipped, mask).item()
        m["entropy"] = masked_mean(entropy.detach(), mask).item()
        m["ratio_dev"] = ((ratio - 1).abs() * mask).max().item()
    return aggregate(tok_loss, mask, normalizer), canary_share(mask, normalizer), m


def check_on_policy(deviation: float, cfg: RLConfig, rollout: int) -> None:
    if cfg.algo.ratio_check == "off" or deviation <= cfg.algo.ratio_tol:
        return
    msg = (f"on-policy check failed at rollout {rollout}: max |ratio - 1| = {deviation:.3g} > algo.ratio_tol={cfg.algo.ratio_tol} "
           "at the first update after the rollout; the old log-probs are stale or computed differently from the loss's")
    if cfg.algo.ratio_check == "error":
        raise OnPolicyCheckError(msg)
    warnings.warn(msg, stacklevel=2)


def update_policy(model, engine, samples: list[Sample], cfg: RLConfig, rollout: int, group_rng: random.Random, pad_id: int,
                  kl_coef: float | None = None):
    """PPO epochs x mini-batches over one rollout, one optimizer step each.

    Yields (is_first_update, step_loss, per-micro-batch metrics, engine stats) per step. The
    first update's micro-batches are the ones old log-probs were computed in, so its ratio
    must be exactly 1 (check_on_policy).
    """
    a, t = cfg.algo, cfg.train
    norm_len = t.loss_agg_norm or cfg.rollout.max_new_tokens
    groups = [samples[i : i + a.group_size] for i in range(0, len(samples), a.group_size)]
    for epoch in range(a.ppo_epochs):
        if epoch > 0:  # reshuffle whole groups, never splitting one across optimizer steps
            group_rng.shuffle(groups)
        order = [s for g in groups for s in g]
        for start in range(0, len(order), t.global_batch_size):
            batch = order[start : start + t.global_batch_size]
            plan = plan_step([len(s.response_ids) for s in batch], t.micro_batch_size, t.loss_agg, norm_len)
            step_loss, parts = 0.0, []
            for mb in plan.micro_batches:
                loss, share, m = policy_micro_batch_loss(model, engine, [batch[i] for i in mb], plan.normalizer, cfg, pad_id, kl_coef)
                engine.backward(loss, share, num_samples=len(mb))
                step_loss += loss.item()
                parts.append(m)
            first = epoch == 0 and start == 0
            if first:
                check_on_policy(max(p["ratio_dev"] for p in parts), cfg, rollout)
            yield first, step_loss, parts, engine.step(plan)


def train_rl(cfg: RLConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "rl",
             model_path: str | None = None, final_name: str = "final") -> RLResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    model_path = model_path or resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "rl_train", spec), resolve(cfg.data.eval, "eval", spec)
    tok = load_tokenizer(model_path)
    prompts = encode_prompts(read_jsonl(train_path), tok, cfg.data.max_length)
    eval_prompts = load_eval_prompts(cfg, tok, eval_path)
    reward_fns = load_rewards(cfg.reward.fn, cfg.reward.weights, cfg.reward.timeout, cfg.reward.retries)
    if cfg.train.resume_from:
        check_resumable(cfg.train.resume_from)
    run_dir, log = open_run(cfg, "rl", run_dir, {"train": train_path, "eval": eval_path})
    model = load_causal_lm(cfg.train.resume_from or model_path)
    ref = load_causal_lm(model_path, trainable=False) if cfg.algo.kl_coef > 0 else None

    a, t = cfg.algo, cfg.train
    steps_per_rollout = a.ppo_epochs * a.mini_batches
    prompts_per_rollout = t.global_batch_size * a.mini_batches // a.group_size
    rollouts = math.ceil(t.max_steps / steps_per_rollout) if t.max_steps else max(1, math.ceil(t.epochs * len(prompts) / prompts_per_rollout))
    steps = rollouts * steps_per_rollout
    engine = build_engine(model, cfg, steps)
    generator = HFEngine(model, tok, cfg.rollout.batch_size)
    sampler = StepSampler(len(prompts), prompts_per_rollout, t.seed)
    group_rng = random.Random(f"{t.seed}-minibatches")
    first_rollout = 0
    kl_control = AdaptiveKL(a.kl_coef, a.kl_target, a.kl_horizon)
    if t.resume_from:
        position = resume(t.resume_from, engine)
        first_rollout = position["rollout"] + 1
        group_rng.setstate(position["group_rng"])
        kl_control.coef = position.get("kl_coef", kl_control.coef)

    gen_tokens, t0, step = 0, time.perf_counter(), first_rollout * steps_per_rollout
    bar = progress(steps, phase, step)
    for rollout in range(first_rollout, rollouts):
        tg = time.perf_counter()
        if a.name == "dapo":
            samples, rstats = collect_dynamic_rollout(generator, prompts, sampler.batch(rollout), rollout, reward_fns, cfg)
        else:
            samples, rstats = collect_rollout(generator, [prompts[i] for i in sampler.batch(rollout)], reward_fns, cfg)
        gen_seconds = time.perf_counter() - tg
        gen_tokens += rstats["generated_tokens"]
        attach_logprobs(model, samples, "old_logprobs", t.micro_batch_size, tok.pad_token_id, cfg.rollout.temperature, engine.autocast)
        if ref is not None:
            attach_logprobs(ref, samples, "ref_logprobs", t.micro_batch_size, tok.pad_token_id, cfg.rollout.temperature, engine.autocast)
        kl_coef = kl_control.coef  # this rollout's; the controller moves it for the next
        if ref is not None:
            rstats["rollout_kl"], rstats["kl_coef"] = kl_control.update(samples), kl_coef
        attach_advantages(samples, cfg, kl_coef)
        for first, step_loss, parts, stats in update_policy(model, engine, samples, cfg, rollout, group_rng, tok.pad_token_id,
                                                            kl_coef):
            step += 1
            bar.update(1)
            bar.set_postfix(reward=f"{rstats['reward_mean']:.3f}")
            if step % t.log_every == 0 or step == steps:
                mean = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0] if k != "ratio_dev"}
                log.write({"phase": phase, "step": step, "rollout": rollout, "loss": step_loss, **mean, **stats,
                           **{k: v for k, v in rstats.items() if k != "generated_tokens"},
                           "gen_tokens_per_s": rstats["generated_tokens"] / gen_seconds,
                           "ratio_dev_first": max(p["ratio_dev"] for p in parts) if first else None})
            after_step(cfg, phase, step, steps, model, tok, engine, eval_prompts, log, run_dir, bar,
                       {"step": step, "rollout": rollout, "group_rng": group_rng.getstate(), "kl_coef": kl_control.coef})
    bar.close()
    seconds = time.perf_counter() - t0
    final = finish(cfg, phase, steps, model, tok, engine, eval_prompts, log, run_dir, final_name)
    return RLResult(run_dir, final, steps, seconds, gen_tokens)
