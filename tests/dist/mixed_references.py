"""The one-pass references of the mixed-policy methods' cases in rl_equivalence.py, each written from its
paper's formula with plain torch: LUFFY's and SRFT's groups holding a demonstration, UFT's and
Prefix-RFT's hinted sequences, CHORD's and HPT's GRPO-plus-SFT steps, ReLIFT's SFT step under the mean of
micro-batch means; and the padding and aggregation helpers every reference of that file shares."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from exactrl.algorithms.sft_rl import sft_step_plan
from exactrl.data.batch import Sample

NORM_LEN = 12.0  # the constant length of seq-mean-token-sum-norm (rl_equivalence.py passes it to the config)


@dataclass(slots=True)
class ScoredSample(Sample):
    seq_advantage: float = 0.0  # GSPO's one advantage per response (sequence_advantages)

def padded(samples, pad_id):
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, attn


def spans(samples):
    return [slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids)) for s in samples]


def in_groups(samples: list[Sample]) -> list[Sample]:
    """The rollout with each group's last response a demonstration (LUFFY's and SRFT's groups):
    micro-batches of 2 then hold 0 or 1 demonstration, and its tokens a varying share."""
    out = [copy.copy(s) for s in samples]
    for s in out[3::4]:
        s.source = "demonstration"
    return out


def reference_group_demo_loss(model, samples, tok, case):
    """LUFFY (arXiv 2504.14945, its objective): the clipped ratio on the policy's tokens, p / (p + 0.1) on the
    demonstrations', one token-mean over both. SRFT (arXiv 2506.19767): on demonstrations
    0.5 sg(e^-H) NLL - min(p A, clip(p) A), on the policy's responses 0.1 sg(e^H) NLL if the reward is 1
    else log p; a token-mean over each."""
    ids, attn = padded(samples, tok.pad_token_id)
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    groups = {"demonstration": [], "on_policy": []}
    for b, (s, sl) in enumerate(zip(samples, spans(samples))):
        lp = logp_all[b, sl].gather(-1, ids[b, 1:][sl][:, None])[:, 0]
        h = -(logp_all[b, sl].exp() * logp_all[b, sl]).sum(-1).detach()
        adv, p = s.advantages[sl], lp.exp()
        if case["loss"] == "luffy":
            if s.source == "demonstration":
                tok_loss = -p / (p + 0.1) * adv
            else:
                ratio = torch.exp(lp - s.old_logprobs[sl])
                tok_loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            groups["on_policy"].append(tok_loss)
        elif s.source == "demonstration":
            groups["demonstration"].append(0.5 * torch.exp(-h) * -lp - torch.minimum(p * adv, p.clamp(0.8, 1.2) * adv))
        else:
            groups["on_policy"].append(0.1 * torch.exp(h) * -lp if s.reward == 1.0 else lp)
    return sum(aggregate_by_definition(g, case["mode"]) for g in groups.values() if g)
def hinted(samples: list[Sample]) -> list[Sample]:
    """The rollout as UFT and Prefix-RFT train it: the first (i % 4) / 4 of response i written by a
    demonstration (origin "demonstration"), the rest by the policy, so micro-batches hold different
    shares of each."""
    out = []
    for i, (s, sl) in enumerate(zip(samples, spans(samples))):
        h = len(s.response_ids) * (i % 4) // 4
        out.append(copy.copy(s))
        out[-1].origin = ("policy",) * sl.start + ("demonstration",) * h + ("policy",) * (len(s.response_ids) - h)
    return out


def top_entropy(entropy: torch.Tensor, prefix: torch.Tensor, keep: float) -> torch.Tensor:
    """Prefix-RFT's selection, by definition: of a row's n prefix tokens, the n - int(n (1 - keep))
    of highest entropy."""
    idx = prefix.nonzero().flatten().tolist()
    chosen = sorted(idx, key=lambda t: -float(entropy[t]))[: len(idx) - int(len(idx) * (1 - keep))]
    return torch.tensor([t in chosen for t in range(len(prefix))])
def with_demonstrations(samples: list[Sample], tok) -> list[Sample]:
    """The rollout followed by three demonstrations of uneven length (CHORD's and HPT's steps):
    a step of 11 samples whose micro-batches hold different shares of the two kinds of token."""
    g = torch.Generator().manual_seed(12)
    demos = []
    for i, n in enumerate((9, 2, 5)):
        demo = ScoredSample(tok(f"{i}*{i + 3}=")["input_ids"], torch.randint(7, 20, (n,), generator=g).tolist(),
                            source="demonstration")
        for key in ("advantages", "old_logprobs", "ref_logprobs", "old_values", "returns"):
            setattr(demo, key, torch.zeros(demo.num_targets))  # read by no term of a demonstration
        demos.append(demo)
    return samples + demos


def chord_mu(step: int) -> float:
    """CHORD's mu (arXiv 2508.11408) for MIXED_MU: linear warm-up from 0, then cosine to the valley."""
    warmup, decay, peak, valley = MIXED_MU
    if step < warmup:
        return peak * step / warmup
    if step >= warmup + decay:
        return valley
    return valley + (peak - valley) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / decay))


MIXED_MU = (1, 2, 0.6, 0.2)  # warm-up, decay, peak, valley: mu is 0 at the first step, 0.6 at the second
HPT_SFT_COEF = 0.3


def aggregate_by_definition(per_token: list[torch.Tensor], mode: str) -> torch.Tensor:
    if mode == "token-mean":
        return torch.cat(per_token).sum() / sum(t.numel() for t in per_token)
    if mode == "seq-mean-token-mean":
        return torch.stack([t.mean() for t in per_token]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([t.sum() for t in per_token]).mean()
    return torch.stack([t.sum() for t in per_token]).sum() / (len(per_token) * NORM_LEN)


def reference_sft_mix_loss(model, samples, tok, case, step):
    """CHORD: (1 - mu) x clipped surrogate over the on-policy tokens' mean + mu x sg(p (1 - p)) NLL over
    the demonstration tokens' mean; HPT: the surrogate's mean + HPT_SFT_COEF x the NLL's mean."""
    ids, attn = padded(samples, tok.pad_token_id)
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    lo, hi = case.get("clip", (0.2, 0.2))
    policy, demo = [], []
    for b, (s, sl) in enumerate(zip(samples, spans(samples))):
        lp = logp_all[b, sl].gather(-1, ids[b, 1:][sl][:, None])[:, 0]
        if s.source == "demonstration":
            p = lp.detach().exp()
            demo.append(-lp * (p * (1 - p) if case["loss"] == "chord" else 1.0))
        else:
            ratio, adv = torch.exp(lp - s.old_logprobs[sl]), s.advantages[sl]
            policy.append(-torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv))
    surrogate, nll = torch.cat(policy).mean(), torch.cat(demo).mean()
    if case["loss"] == "hpt":
        return surrogate + HPT_SFT_COEF * nll
    mu = chord_mu(step)
    return (1 - mu) * surrogate + mu * nll


def reference_mean_of_means(model, samples, tok, case):
    """ReLIFT's SFT step as its code computes it: each micro-batch's token-mean NLL, averaged over
    the micro-batches of every rank (the plan's, so the same samples share a micro-batch)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    ids, attn = padded(samples, tok.pad_token_id)
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    nll = [-logp_all[b, sl].gather(-1, ids[b, 1:][sl][:, None])[:, 0] for b, sl in enumerate(spans(samples))]
    means = [torch.cat([nll[i] for i in mb]).mean() for mb in sft_step_plan(samples, case["micro"], world,
                                                                           True).micro_batches]
    return torch.stack(means).mean()
