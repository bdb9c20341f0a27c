"""Hinted rollouts: the policy continues a prefix of the prompt's demonstration (UFT's hint,
Prefix-RFT's prefix), whose length a schedule shrinks over training.

A sample's response is the prefix then the policy's continuation, one sequence: its targets'
``origin`` marks the prefix tokens "demonstration" and the continuation "policy" (data/batch.py),
so the objective's terms can train them differently. The reward scores the whole response text
(prefix and continuation: the trajectory the policy completed). Each row asks the generator for
one response to prompt + prefix; every random choice -- a prefix's length, a continuation's
tokens -- draws from a stream keyed by (train.seed, rollout, the prompt's position in the rollout,
the sample's index) (rollout/generator.py ``prompt_seeds``), so neither the number of ranks nor
the batching changes a rollout. Samples carry no generator log-probs (the generator never scores
the prefix): the loop computes the old log-probs with the trainer, and the on-policy check is
against those.

The schedules, one per method, take the optimizer steps done before the rollout:
- UFT (Liu et al. 2025, arXiv 2505.16984; liumy2010/UFT verl/utils/dataset/rl_dataset.py): the
  expected hint share p(t) = low + (high - low)(1 + cos(pi t / T)) / 2 up to T = hint_steps, then no
  hint; the demonstration is cut into ``parts`` equal parts and a prompt's hint is the first k,
  k ~ Binomial(parts, p(t)), shared by its whole group (the code draws it per prompt). The code
  cuts a list of reasoning steps; exactrl cuts the demonstration's tokens, and never hands over its
  last token (EOS), so the policy always writes at least that.
- Prefix-RFT (Huang et al. 2025, arXiv 2507.01679, A.2; ZeroYuHuang/prefix_rft
  recipe/prefix_rft/rl_dataset.py and scheduler/global_step.py): ``prefixed`` responses of a group
  continue a prefix of int(l x the demonstration's length) tokens (at most all but its last),
  l ~ U[low(t), high], each its own draw; low(t) decays along a half cosine from low_start to
  low_end over decay_steps; the rest of the group is sampled from the prompt alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.distributed.collectives import gather, shard
from exactrl.rewards import score_all
from exactrl.rollout.collect import add_model_reward, overlong_penalty, rollout_stats
from exactrl.rollout.generator import SamplingParams, prompt_seeds


def uft_hint_share(step: int, low: float, high: float, steps: int) -> float:
    """UFT's expected hint share of the demonstration before optimizer step ``step``: cosine from
    ``high`` at 0 to ``low`` at ``steps``, then 0 (no hint)."""
    if step > steps:
        return 0.0
    return low + 0.5 * (high - low) * (1 + math.cos(math.pi * step / steps))


def uft_hint_length(demo_len: int, parts: int, share: float, rng: random.Random) -> int:
    """A UFT hint's length in tokens: the first k of ``parts`` equal parts of the demonstration
    without its last token, k ~ Binomial(parts, share) (fewer parts than tokens: one per token)."""
    body = demo_len - 1
    parts = min(parts, body)
    if parts <= 0:
        return 0
    k = sum(rng.random() < share for _ in range(parts))
    return round(k / parts * body)


def prefix_low(step: int, start: float, end: float, steps: int) -> float:
    """Prefix-RFT's lower bound of the prefix share before optimizer step ``step``: a half cosine
    from ``start`` at 0 to ``end`` at ``steps``, then held (the code's CosineDecayController)."""
    if step > steps:
        return end
    return end + 0.5 * (1 + math.cos(math.pi * step / steps)) * (start - end)


def prefix_length(demo_len: int, low: float, high: float, rng: random.Random) -> int:
    """A Prefix-RFT prefix's length: int(l x ``demo_len``), l ~ U[low, high], at most demo_len - 1."""
    lo, hi = min(low, high), max(low, high)
    return max(0, min(int((lo + (hi - lo) * rng.random()) * demo_len), demo_len - 1))


def schedule_step(cfg: RLConfig, rollout: int) -> int:
    """The optimizer steps done before rollout ``rollout``: the time the schedules read."""
    return rollout * cfg.algo.ppo_epochs * cfg.algo.mini_batches


def uft_hints(cfg: RLConfig, rollout: int) -> tuple[float, Callable[[int, random.Random], list[int]]]:
    """UFT's scheduled share for this rollout, and a prompt's hint lengths (one per response: the
    group shares one hint) from its demonstration's length and its keyed stream."""
    u, g = cfg.algo.uft, cfg.algo.group_size
    share = uft_hint_share(schedule_step(cfg, rollout), u.hint_low, u.hint_high, u.hint_steps)
    return share, lambda demo_len, rng: [uft_hint_length(demo_len, u.hint_parts, share, rng)] * g


def prefix_rft_hints(cfg: RLConfig, rollout: int) -> tuple[float, Callable[[int, random.Random], list[int]]]:
    """Prefix-RFT's lower bound for this rollout, and a prompt's prefix lengths: one draw for each
    of the first ``prefixed`` responses, none for the others."""
    p, g = cfg.algo.prefix_rft, cfg.algo.group_size
    low = prefix_low(schedule_step(cfg, rollout), p.low_start, p.low_end, p.decay_steps)
    return low, lambda demo_len, rng: [prefix_length(demo_len, low, p.high, rng) for _ in range(p.prefixed)] + [
        0] * (g - p.prefixed)


def hinted_rollout(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg, cfg: RLConfig,
                   hints: Callable) -> tuple[list[Sample], dict]:
    """The rollout of prompts ``indices``, each response continuing the prefix of its prompt's
    demonstration that ``hints(cfg, rollout)`` gives it; this rank generates and scores its share
    of the prompts (whole groups) and gets everyone's samples back, in order."""
    r, a = cfg.rollout, cfg.algo
    level, lengths = hints(cfg, rollout)
    chosen = [prompts[i] for i in indices]
    streams = prompt_seeds(cfg.train.seed, rollout, "hint", positions=range(len(chosen)))
    seeds = prompt_seeds(cfg.train.seed, rollout, "hinted", positions=range(len(chosen) * a.group_size))
    # one row per response: (prompt, its prefix length, its sampling seed), grouped by prompt
    groups = [[(p, h, seeds[pos * a.group_size + j]) for j, h in enumerate(lengths(len(p.demonstration),
                                                                                    random.Random(streams[pos])))]
              for pos, p in enumerate(chosen)]
    rows = [row for group in shard(groups) for row in group]
    params = SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop),
                            max_new_tokens=r.max_new_tokens)
    gens = engine_gen.generate([p.input_ids + p.demonstration[:h] for p, h, _ in rows], params,
                               [seed for _, _, seed in rows])
    responses = [p.demonstration[:h] + g.response_ids for (p, h, _), g in zip(rows, gens)]
    failures: list = []
    rewards, parts = score_all(rewards_cfg, [p.text for p, _, _ in rows],
                               [engine_gen.tok.decode(ids, skip_special_tokens=True) for ids in responses],
                               [p.answer for p, _, _ in rows], [p.source for p, _, _ in rows], cfg.reward.timeout,
                               cfg.reward.fallback, failures)
    samples = []
    for i, ((p, h, _), g, response, rw) in enumerate(zip(rows, gens, responses, rewards)):
        pen = overlong_penalty(len(g.response_ids), r.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
        # target t predicts token t + 1: the prompt's targets, then the prefix's, then the continuation's
        origin = ("policy",) * (len(p.input_ids) - 1) + ("demonstration",) * h + ("policy",) * len(g.response_ids)
        samples.append(Sample(p.input_ids, response, rw + pen, g.finished, {k: v[i] for k, v in parts.items()}, pen,
                              weights_version=g.weights_version, weights_digest=g.weights_digest, origin=origin))
    shares = gather((samples, len(failures)))
    samples = [s for part, _ in shares for s in part]
    add_model_reward(samples, rewards_cfg)
    hinted = [s.origin_tokens.get("demonstration", 0) for s in samples]
    return samples, rollout_stats(samples, sum(n for _, n in shares), cfg) | {
        "generated_tokens": sum(len(s.response_ids) - h for s, h in zip(samples, hinted)),
        "hint_level": level, "hint_tokens": sum(hinted) / len(samples),
        "hinted": sum(h > 0 for h in hinted) / len(samples)}


def uft_rollout(engine_gen, prompts, indices, rollout, rewards_cfg, cfg):
    """UFT's rollout source: every response of a group continues the prompt's scheduled hint."""
    return hinted_rollout(engine_gen, prompts, indices, rollout, rewards_cfg, cfg, uft_hints)


def prefix_rft_rollout(engine_gen, prompts, indices, rollout, rewards_cfg, cfg):
    """Prefix-RFT's rollout source: ``prefixed`` responses of a group continue a scheduled prefix."""
    return hinted_rollout(engine_gen, prompts, indices, rollout, rewards_cfg, cfg, prefix_rft_hints)
