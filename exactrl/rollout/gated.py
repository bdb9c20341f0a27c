"""Rollout sources of the methods that add SFT on demonstrations to GRPO (CHORD, HPT): the
rollout's on-policy groups, then demonstration samples of its prompts, in prompt order.

A demonstration sample is the prompt followed by its demonstration (data/encode.py Prompt), source
"demonstration": only the objective's SFT term reads it (algorithms/sft_rl.py); the loop gives it
no advantage (nothing scored it). Every rank holds the whole rollout, so all choose alike.
"""

from __future__ import annotations

import torch

from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.data.encode import Prompt
from exactrl.rollout.collect import collect_rollout


def demonstration_sample(prompt: Prompt, beside: list[Sample] = ()) -> Sample:
    """``prompt`` followed by its demonstration. When the on-policy rows it will be batched
    ``beside`` carry generator log-probs, it carries zeros (nothing sampled it) so that it collates
    with them; only their policy term reads them."""
    ids = list(prompt.demonstration)
    gen = torch.zeros(len(prompt.input_ids) + len(ids) - 1) if any(s.gen_logprobs is not None for s in beside) else None
    return Sample(list(prompt.input_ids), ids, source="demonstration", gen_logprobs=gen)


def correct(s: Sample) -> bool:
    """A response counts as correct when its first reward is at least 1 (as rollout accuracy counts it)."""
    return next(iter(s.parts.values())) >= 1.0


def with_demonstrations(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
                        cfg: RLConfig) -> tuple[list[Sample], dict]:
    """CHORD (arXiv 2508.11408): the rollout's groups, then one demonstration per prompt, all in
    one step. Trinity-RFT draws its expert samples from a separate SFT set at a fixed ratio
    (expert_data_ratio 0.2); here they are the demonstrations of the rollout's own prompts (equal
    data: the same prompts and demonstrations every method sees), 1 per group_size responses."""
    samples, stats = collect_rollout(engine_gen, [prompts[i] for i in indices], rewards_cfg, cfg, rollout)
    demos = [demonstration_sample(prompts[i], samples) for i in indices]
    return samples + demos, stats | {"demonstrations": len(demos)}


def gated(engine_gen, prompts, indices: list[int], rollout: int, rewards_cfg,
          cfg: RLConfig) -> tuple[list[Sample], dict]:
    """HPT (arXiv 2509.04419): a question whose group has at most algo.hpt.gate correct responses
    is learnt from its demonstration (its responses are dropped), the others by GRPO on their
    groups, as Unify-Post-Training's "switch" strategy (mix_trainer.select_on_off_ada_balance;
    its second band, switch_gate_off, which drops a group without SFT, equals the gate in every
    published script and is left out). ``sft_share``: the share of the rollout's questions sent to SFT."""
    samples, stats = collect_rollout(engine_gen, [prompts[i] for i in indices], rewards_cfg, cfg, rollout)
    g, kept, sft = cfg.algo.group_size, [], []
    for k, i in enumerate(indices):
        group = samples[k * g : (k + 1) * g]
        if sum(correct(s) for s in group) <= cfg.algo.hpt.gate:
            sft.append(demonstration_sample(prompts[i], samples))
        else:
            kept += group
    return kept + sft, stats | {"sft_share": len(sft) / len(indices), "demonstrations": len(sft)}
