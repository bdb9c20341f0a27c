"""Rollouts: sample responses, score them, and share them between ranks.

Under several processes each rank generates and scores an equal, contiguous share of the
rollout's prompts (whole groups: a prompt's responses are all sampled on one rank), then
every rank receives the whole rollout in rank order. Advantages, the adaptive KL and the
step normaliser are then computed over all of it, identically on every rank, so neither the
number of ranks nor how groups fall on them changes an advantage or a sequence's weight.
Log-probs (old, reference, the critic's values) are computed by each rank for the
micro-batches it will train on first, and shared the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from exactrl.config.schema import RLConfig
from exactrl.distributed.launch import rank, world_size
from exactrl.losses.token_losses import token_logprobs
from exactrl.models.packing import model_batch
from exactrl.rewards import score_all


class RolloutError(RuntimeError):
    """A rollout could not be filled (DAPO's dynamic sampling ran out of refill rounds)."""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float  # the weighted sum of the rewards, with any overlong shaping
    finished: bool = True  # the model stopped by itself within rollout.max_new_tokens
    parts: dict[str, float] = field(default_factory=dict)  # each reward.fn's own value
    penalty: float = 0.0  # overlong shaping included in ``reward``
    # Per-token tensors of length len(prompt + response) - 1, aligned with next-token targets:
    advantages: torch.Tensor | None = None  # zero on prompt targets
    old_logprobs: torch.Tensor | None = None  # fixed for the whole rollout
    gen_logprobs: torch.Tensor | None = None  # the generator's, zero on prompt targets
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None  # the critic's, fixed for the rollout (ppo)
    returns: torch.Tensor | None = None  # the critic's targets (ppo)

    @property
    def ids(self) -> list[int]:
        """Prompt and response, the sequence every forward sees."""
        return self.prompt_ids + self.response_ids


def shard(items: list) -> list:
    """This rank's contiguous share of ``items`` (their number divides by the world size)."""
    per = len(items) // world_size()
    return items[rank() * per : (rank() + 1) * per]


def gather(obj) -> list:
    """Every rank's ``obj``, in rank order (a one-element list in one process)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def overlong_penalty(length: int, max_length: int, buffer: int, weight: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to max_length - buffer,
    then falling linearly to -weight at max_length (a response cut off there scores -weight)."""
    if buffer <= 0 or length <= max_length - buffer:
        return 0.0
    return -weight * min(1.0, (length - (max_length - buffer)) / buffer)


def collect_rollout(engine_gen, prompts, rewards_cfg, cfg: RLConfig) -> tuple[list[Sample], dict]:
    """``group_size`` responses to each prompt, scored; this rank does its share of the prompts
    and gets everyone's samples back. Returns (samples, statistics over all of them)."""
    r, a = cfg.rollout, cfg.algo
    mine = shard(list(prompts))
    gens = engine_gen.generate([p.input_ids for p in mine], n=a.group_size, temperature=r.temperature, top_p=r.top_p,
                               max_new_tokens=r.max_new_tokens)
    src = [mine[g.prompt_index] for g in gens]
    failures: list = []
    rewards, parts = score_all(rewards_cfg, [p.text for p in src], [g.text for g in gens], [p.answer for p in src],
                               [p.source for p in src], cfg.reward.timeout, cfg.reward.fallback, failures)
    samples = []
    for i, (g, rw) in enumerate(zip(gens, rewards)):
        pen = overlong_penalty(len(g.response_ids), r.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
        gen_lp = None if g.logprobs is None else torch.tensor([0.0] * (len(g.prompt_ids) - 1) + g.logprobs)
        samples.append(Sample(g.prompt_ids, g.response_ids, rw + pen, g.finished, {k: v[i] for k, v in parts.items()}, pen,
                              gen_logprobs=gen_lp))
    shares = gather((samples, len(failures)))
    samples = [s for part, _ in shares for s in part]
    return samples, rollout_stats(samples, sum(n for _, n in shares), cfg)


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
    tokens = sum(len(s.response_ids) for s in samples)
    return stats | {"response_length": tokens / len(samples), "finished": sum(s.finished for s in samples) / len(samples),
                    "reward_failures": failures, "rollout_prompts": len(samples) // cfg.algo.group_size,
                    "rollout_responses": len(samples), "generated_tokens": tokens}


def collect_dynamic_rollout(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
                            cfg: RLConfig) -> tuple[list[Sample], dict]:
    """DAPO's dynamic sampling: groups whose responses all got the same reward carry no signal
    (zero advantage) and are dropped; fresh prompts (a deterministic draw per rollout and round,
    so resumed runs draw the same) are sampled until the rollout holds as many groups as asked.
    Every rank sees the whole rollout, so all make the same choice."""
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


def consecutive(n: int, size: int) -> list[list[int]]:
    """Micro-batches [0, size), [size, 2 size), ... of n samples."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


@torch.no_grad()
def attach_per_token(samples: list[Sample], attr: str, micro_batches: list[list[int]], compute: Callable) -> None:
    """``compute(chunk) -> [B, L-1]`` for this rank's ``micro_batches`` (indices into samples),
    stored on each sample as ``attr``; then every rank receives every sample's values."""
    mine = {}
    for mb in micro_batches:
        rows = compute([samples[i] for i in mb])
        for i, row in zip(mb, rows):
            s = samples[i]
            # Kept on the CPU between passes (collate moves them back): a rollout's worth of
            # per-token fields stays off the GPU, and gather pickles CPU tensors.
            mine[i] = row[: len(s.prompt_ids) + len(s.response_ids) - 1].to("cpu", copy=True)
    for part in gather(mine):
        for i, row in part.items():
            setattr(samples[i], attr, row)
    missing = [i for i, s in enumerate(samples) if getattr(s, attr) is None]
    if missing:
        raise RuntimeError(f"{attr} was computed for no micro-batch holding samples {missing[:8]}")


def attach_logprobs(model, samples: list[Sample], attr: str, micro_batches: list[list[int]], pad_id: int, temperature: float,
                    autocast, packed: bool = True, logprob_chunk: int = 0) -> None:
    """Each sample's per-token log-probs, computed in the micro-batches training will use
    (``packed``: padding-free, as the training forward)."""

    def compute(chunk):
        mb = model_batch(model, [s.ids for s in chunk], pad_id, packed)
        with autocast():
            logits = model(**mb.inputs).logits
        return mb.repad(token_logprobs(logits, mb.inputs["input_ids"], temperature, logprob_chunk))

    attach_per_token(samples, attr, micro_batches, compute)
