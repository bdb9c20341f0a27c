"""The rollout of methods whose GRPO groups hold demonstrations (LUFFY, SRFT): each group of
algo.group_size is the policy's group_size - m samples of the prompt, then m copies of the
prompt's demonstration (m = algo.<name>.demonstrations; a prompt has one demonstration, so m > 1
repeats it, as LUFFY's code does with n_prefix > 1 and one target per prompt). Demonstrations are
scored by the same rewards as the policy's responses (a wrong one gets a low advantage, not a
free pass), each rank its share of the prompts, like the sampling.

A demonstration sample has source "demonstration" and, as its generator log-probs, zeros: the
behaviour probability both methods take as 1 (log 1 = 0) for tokens the policy never sampled.
The rollout's statistics (reward, accuracy, lengths) are the policy's samples'; the
demonstrations' mean reward is logged beside them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.distributed.collectives import gather, shard
from exactrl.rewards import score_all
from exactrl.rollout.collect import add_model_reward, collect_rollout


def demonstration_samples(prompts, texts: list[str], rewards_cfg, cfg: RLConfig) -> tuple[list[Sample], int]:
    """One scored demonstration sample per prompt (this rank's share, then everyone's) and the
    number of reward failures. ``texts``: the demonstrations decoded as the reward reads responses."""
    mine, mine_texts = shard(list(prompts)), shard(texts)
    failures: list = []
    rewards, parts = score_all(rewards_cfg, [p.text for p in mine], mine_texts, [p.answer for p in mine],
                               [p.source for p in mine], cfg.reward.timeout, cfg.reward.fallback, failures)
    samples = [Sample(p.input_ids, list(p.demonstration), rw, True, {k: v[i] for k, v in parts.items()},
                      source="demonstration",
                      gen_logprobs=torch.zeros(len(p.input_ids) + len(p.demonstration) - 1))
               for i, (p, rw) in enumerate(zip(mine, rewards))]
    shares = gather((samples, len(failures)))
    samples = [s for part, _ in shares for s in part]
    add_model_reward(samples, rewards_cfg)
    return samples, sum(n for _, n in shares)


def mixed_rollout(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
                  cfg: RLConfig) -> tuple[list[Sample], dict]:
    """Groups of the policy's samples followed by the prompt's demonstration(s), in prompt order."""
    m = getattr(cfg.algo, cfg.algo.name).demonstrations
    n = cfg.algo.group_size - m
    chosen = [prompts[i] for i in indices]
    policy_cfg = cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"group_size": n})})
    samples, stats = collect_rollout(engine_gen, chosen, rewards_cfg, policy_cfg, rollout)
    texts = [engine_gen.tok.decode(p.demonstration, skip_special_tokens=True) for p in chosen]
    demos, failures = demonstration_samples(chosen, texts, rewards_cfg, cfg)
    groups = [samples[k * n : (k + 1) * n] + [replace(demo) for _ in range(m)] for k, demo in enumerate(demos)]
    stats |= {"demo_reward_mean": sum(d.reward for d in demos) / len(demos),
              "reward_failures": stats["reward_failures"] + failures}
    return [s for group in groups for s in group], stats
