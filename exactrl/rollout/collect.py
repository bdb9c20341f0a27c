"""Rollouts: sample responses, score them, and share them between ranks.

Under several processes each rank generates and scores an equal, contiguous share of the
rollout's prompts (whole groups: a prompt's responses are all sampled on one rank), then
every rank receives the whole rollout in rank order. Advantages, the adaptive KL and the
step normaliser are then computed over all of it, identically on every rank, so neither the
number of ranks nor how groups fall on them changes an advantage or a sequence's weight.
Log-probs (old, reference, the critic's values) are computed by each rank for the
micro-batches it will train on first, and shared the same way.

Every response is sampled from its own stream, keyed by (train.seed, rollout, refill round, the
prompt's position in the rollout's prompt list, its sample index): which rank samples it, and
with which batch, does not change it (exactrl/rollout/generator.py).
"""

from __future__ import annotations

import random

import torch

from exactrl.checks.trajectory import check_episodes
from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.distributed.collectives import gather, shard
from exactrl.rewards import score_all
from exactrl.rollout.generator import SamplingParams, prompt_seeds
from exactrl.rollout.multiturn import SUMMED, episode_counts, to_sample


class RolloutError(RuntimeError):
    """A rollout could not be filled (DAPO's dynamic sampling ran out of refill rounds)."""


def overlong_penalty(length: int, max_length: int, buffer: int, weight: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to max_length - buffer,
    then falling linearly to -weight at max_length (a response cut off there scores -weight)."""
    if buffer <= 0 or length <= max_length - buffer:
        return 0.0
    return -weight * min(1.0, (length - (max_length - buffer)) / buffer)


def collect_rollout(engine_gen, prompts, rewards_cfg, cfg: RLConfig, rollout: int,
                    refill_round: int = 0) -> tuple[list[Sample], dict]:
    """``group_size`` responses to each prompt, scored; this rank does its share of the prompts
    and gets everyone's samples back. Returns (samples, statistics over all of them)."""
    r, a = cfg.rollout, cfg.algo
    mine = shard(list(prompts))
    seeds = shard(prompt_seeds(cfg.train.seed, rollout, refill_round, positions=range(len(prompts))))
    params = SamplingParams(n=a.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop),
                            max_new_tokens=r.max_new_tokens)
    if rewards_cfg.episodes is not None:  # env.*: multi-turn episodes (rollout/multiturn.py)
        samples, failures, counts = episode_rollout(rewards_cfg, engine_gen, mine, seeds, params, cfg)
        shares = gather((samples, len(failures), counts))
        samples = [s for part, _, _ in shares for s in part]
        add_model_reward(samples, rewards_cfg)
        return samples, rollout_stats(samples, sum(n for _, n, _ in shares), cfg) | merge_counts(
            [c for _, _, c in shares])
    gens = engine_gen.generate([p.input_ids for p in mine], params, seeds)
    src = [mine[g.prompt_index] for g in gens]
    failures: list = []
    rewards, parts = score_all(rewards_cfg, [p.text for p in src], [g.text for g in gens], [p.answer for p in src],
                               [p.source for p in src], cfg.reward.timeout, cfg.reward.fallback, failures)
    samples = []
    for i, (g, rw) in enumerate(zip(gens, rewards)):
        pen = overlong_penalty(len(g.response_ids), r.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
        gen_lp = None if g.logprobs is None else torch.tensor([0.0] * (len(g.prompt_ids) - 1) + g.logprobs)
        samples.append(Sample(g.prompt_ids, g.response_ids, rw + pen, g.finished, {k: v[i] for k, v in parts.items()},
                              pen,
                              weights_version=g.weights_version, weights_digest=g.weights_digest,
                              gen_logprobs=gen_lp))
    shares = gather((samples, len(failures)))
    samples = [s for part, _ in shares for s in part]
    add_model_reward(samples, rewards_cfg)
    return samples, rollout_stats(samples, sum(n for _, n in shares), cfg)


def episode_rollout(rewards_cfg, engine_gen, prompts, seeds, params, cfg: RLConfig) -> tuple[list[Sample], list,
                                                                                                 dict]:
    """This rank's episodes as samples, checked (checks/trajectory.py), the reward failures, and the episodes'
    counts (env/*) as sums with their number, for merge_counts."""
    runner = rewards_cfg.episodes
    episodes = runner.run(engine_gen.generate, prompts, seeds, params)
    failures: list = []
    src = [e.prompt for e in episodes]
    if cfg.env.reward_fn:
        finals, parts = score_all(rewards_cfg, [p.text for p in src], [e.final_text for e in episodes],
                                  [p.answer for p in src], [p.source for p in src], cfg.reward.timeout,
                                  cfg.reward.fallback, failures)
    else:
        finals, parts = [0.0] * len(episodes), {}
    samples = []
    for i, e in enumerate(episodes):
        s = to_sample(e, finals[i])
        s.parts = {k: (0.0 if e.error else v[i]) for k, v in parts.items()} | {
            "env": s.reward - (0.0 if e.error else finals[i])}
        samples.append(s)
    counts = episode_counts(episodes) | check_episodes(samples, episodes, runner.tok)
    return samples, failures, {k: (v, len(episodes)) for k, v in counts.items()}


def merge_counts(shares: list[dict]) -> dict:
    """Every rank's episode counts as one figure each: means over episodes, sums for counts ("errors", "drift")."""
    out = {}
    for key in shares[0]:
        total, n = sum(c[key][0] for c in shares), sum(c[key][1] for c in shares)
        out[key] = total if key in SUMMED else total / max(n, 1)
    return out


def add_model_reward(samples: list[Sample], rewards) -> None:
    """reward.model's part of each sample's reward, "model" among its parts (reward/model): the reward model reads
    the ids as sampled, which every rank holds once the rollout is gathered, and scores its share of them."""
    if rewards.model is None:
        return
    for s, score in zip(samples, rewards.model(samples)):
        s.parts["model"] = score
        s.reward += rewards.model.weight * score


def generated(s: Sample) -> int:
    """The tokens the generator sampled for ``s``: its response, or an episode's policy turns (not the
    observations and template tokens between them)."""
    return len(s.response_ids) if s.turn_spans is None else sum(b - a for a, b in s.turn_spans)


def rollout_stats(samples: list[Sample], failures: int, cfg: RLConfig) -> dict:
    """What a rollout held: rewards (each component when there are several), accuracy by the
    first reward, lengths, and how many prompts, responses and tokens it sampled."""
    rw = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    specs = list(samples[0].parts)
    stats = {"reward_mean": rw.mean().item(), "reward_std": rw.std().item() if len(samples) > 1 else 0.0,
             "accuracy": sum(s.parts[specs[0]] >= 1.0 for s in samples) / len(samples)}
    if len(specs) > 1:
        stats |= {f"reward/{k}": sum(s.parts[k] for s in samples) / len(samples) for k in specs}
    if cfg.algo.overlong_buffer:
        stats["overlong_penalty"] = sum(s.penalty for s in samples) / len(samples)
    tokens = sum(generated(s) for s in samples)
    return stats | {"response_length": tokens / len(samples), "finished": sum(s.finished for s in samples) / len(
        samples),
                    "reward_failures": failures, "rollout_prompts": len(samples) // cfg.algo.group_size,
                    "rollout_responses": len(samples), "generated_tokens": tokens}


def plain_rollout(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
                  cfg: RLConfig) -> tuple[list[Sample], dict]:
    """The rollout of prompts ``indices`` as drawn (the rollout source of most algorithms)."""
    return collect_rollout(engine_gen, [prompts[i] for i in indices], rewards_cfg, cfg, rollout)


def collect_dynamic_rollout(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
                            cfg: RLConfig) -> tuple[list[Sample], dict]:
    """DAPO's dynamic sampling: groups whose responses all got the same reward carry no signal
    (zero advantage) and are dropped; fresh prompts (a deterministic draw per rollout and round,
    so resumed runs draw the same) are sampled until the rollout holds as many groups as asked.
    Every rank sees the whole rollout, so all make the same choice. The statistics are those of
    the groups kept (the ones trained on); generated_tokens and reward_failures count every round."""
    want, g = len(indices), cfg.algo.group_size
    rng = random.Random(f"{cfg.train.seed}-refill-{rollout}")
    kept, dropped, tokens, failures = [], 0, 0, 0
    for rounds in range(cfg.algo.dapo.max_refill_rounds + 1):
        samples, st = collect_rollout(engine_gen, [prompts[i] for i in indices], rewards_cfg, cfg, rollout, rounds)
        tokens, failures = tokens + st["generated_tokens"], failures + st["reward_failures"]
        for start in range(0, len(samples), g):
            group = samples[start : start + g]
            if len({s.reward for s in group}) > 1:
                kept.append(group)
            else:
                dropped += 1
        if len(kept) >= want:
            trained = [s for group in kept[:want] for s in group]
            return trained, rollout_stats(trained, failures, cfg) | {"generated_tokens": tokens,
                                                                     "groups_dropped": dropped,
                                                                      "refill_rounds": rounds}
        indices = rng.sample(range(len(prompts)), want)
    raise RolloutError(f"dynamic sampling kept {len(kept)} of {want} groups after "
                       f"algo.dapo.max_refill_rounds={cfg.algo.dapo.max_refill_rounds} refills ({dropped} groups had "
                       "all-equal rewards); raise it, or the task is too easy or too hard for the policy")
