"""The objectives of the hinted mixed-policy methods, UFT and Prefix-RFT: each takes the standard
objective of registry.py (the clipped surrogate, the KL and entropy terms as configured) and
makes it the method's. Their rollouts (a demonstration's prefix continued by the policy, its
length scheduled) are exactrl/rollout/hinted.py; a response's prefix tokens have origin
"demonstration", its continuation "policy" (data/batch.py)."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from exactrl.config.loader import ConfigError
from exactrl.losses.objective import NLLTerm, Objective
from exactrl.losses.prefix import PrefixPolicyTerm


def uft_objective(base: Objective, cfg) -> Objective:
    """UFT (Liu et al. 2025, arXiv 2505.16984): GRPO on the policy's continuation -- the standard
    terms scoped to its tokens, as the official code (liumy2010/UFT, dp_actor.py) applies its policy,
    KL and entropy losses to the response after the hint -- plus algo.uft.nll_coef x the NLL of the
    hint's tokens under their own normaliser (the code's masked mean over hint tokens, taken there
    per micro-batch and averaged over micro-batches; here over the whole step, or the paper's sum
    per hint with nll_agg=seq-mean-token-sum). The code also clamps the hint's logits to [-100, 100]
    before that NLL; exactrl does not (it changes nothing for logits in that range)."""
    u = cfg.algo.uft
    terms = tuple(replace(t, origins=("policy",)) for t in base.terms)
    nll = (NLLTerm(coef=u.nll_coef, origins=("demonstration",), agg=u.nll_agg),) if u.nll_coef > 0 else ()
    return replace(base, terms=(*terms, *nll))


def prefix_rft_objective(base: Objective, cfg) -> Objective:
    """Prefix-RFT (Huang et al. 2025, arXiv 2507.01679): the clipped surrogate over every response
    token, prefix included, with the advantages of each prefix's low-entropy tokens zeroed
    (losses/prefix.py); the KL and entropy terms as configured, over the whole response as the
    official code's defaults apply them. Advantages: ``prefix_rft_advantages``."""
    a, p = cfg.algo, cfg.algo.prefix_rft
    if p.prefixed > a.group_size:
        raise ConfigError(f"algo.prefix_rft.prefixed={p.prefixed} responses of a group continue a prefix, more than "
                          f"algo.group_size={a.group_size}: set it to at most the group size")
    if p.advantage == "code" and p.prefixed == a.group_size:
        raise ConfigError(f"algo.prefix_rft.advantage=code centres rewards on a group's responses without a prefix, "
                          f"and algo.prefix_rft.prefixed={p.prefixed} leaves none of the {a.group_size}: prefix fewer")
    if p.advantage == "code" and a.kl_coef > 0 and a.kl_in_reward:
        raise ConfigError("algo.prefix_rft.advantage=code reads each response's outcome reward only, so a KL in the "
                          "reward would land nowhere: set algo.kl_in_reward=false (or algo.prefix_rft.advantage=group)")
    swap = [PrefixPolicyTerm(**{f.name: getattr(t, f.name) for f in fields(t)}, keep=p.keep, clip_prefix=p.clip_prefix)
            if t.kind == "policy" else t for t in base.terms]
    return replace(base, terms=tuple(swap))


def prefix_rft_advantages(samples, rewards: torch.Tensor, cfg) -> None:
    """With algo.prefix_rft.advantage=group (the default) nothing changes: Dr.GRPO's group-centred
    rewards, prefixed responses in the group (the paper's A.2 trains with Dr.GRPO). With "code",
    the official code's prefix-aware advantages (core_algos.py
    compute_dr_grpo_prefix_outcome_advantage, one rollout per prefix): a group's responses without
    a prefix are centred on their own mean (0 when there is only one), a prefixed response's
    continuation keeps its reward uncentred (its prefix is a group of one, whose mean the code takes
    as 0), and its prefix tokens get its reward minus the unprefixed responses' mean."""
    if cfg.algo.prefix_rft.advantage == "group":
        return
    g = cfg.algo.group_size
    for start in range(0, len(samples), g):
        group, scores = samples[start : start + g], rewards[start : start + g].tolist()
        prefixed = [bool(s.origin_tokens.get("demonstration")) for s in group]
        plain = [r for r, p in zip(scores, prefixed) if not p]
        base = sum(plain) / len(plain) if len(plain) > 1 else 0.0
        for s, r, p in zip(group, scores, prefixed):
            adv = torch.zeros(s.num_targets)
            adv[len(s.prompt_ids) - 1 :] = r if p else r - base
            if p:  # the prefix's loss tokens
                on = [o == "demonstration" and m == 1 for o, m in zip(s.token_origins, s.loss_mask)]
                adv[torch.tensor(on)] = r - base
            s.advantages = adv
