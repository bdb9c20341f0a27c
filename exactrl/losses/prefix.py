"""Prefix-RFT's policy loss (Huang et al. 2025, arXiv 2507.01679): the clipped surrogate on a
sequence whose response opens with a demonstration's prefix, which the policy then continues.
Every response token, the prefix's included, is trained with the sequence's advantage, except
the prefix tokens at which the policy is most certain: only the ``keep`` share of a prefix's
tokens with the highest entropy carry their advantage, the others carry zero (the paper's
"entropy-based clipping", sec. 3; keep = 20% in its A.2). A low-entropy token the policy already
predicts gives little to learn, and one it confidently disagrees with would be a sharp overwrite.

Where the official code (ZeroYuHuang/prefix_rft, recipe/prefix_rft/dp_actor.py ``reshape_func``,
"entropy") and exactrl differ:
- The code ranks the prefix tokens of a whole micro-batch together (the paper: "for each
  mini-batch"), so which tokens train depends on how samples fall into micro-batches and ranks.
  exactrl ranks each sequence's prefix tokens among themselves: the same tokens train on any
  layout, as exactrl's exactness promise requires; with one prefixed response per group, as the
  paper samples, a micro-batch rarely holds more than one prefix anyway.
- As in the code, a deselected token keeps its place in the normaliser (its advantage is zeroed,
  the token is not masked) and the entropy is the training forward's own, detached (at the first
  update after a rollout, the rollout policy's).
- ``clip_prefix``: the code's ``enable_clip`` (default true) clips the prefix tokens' ratio like
  the policy's; false trains them with the unclipped ratio x advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.data.batch import ORIGINS
from exactrl.losses.objective import PolicyTerm

DEMONSTRATION = ORIGINS.index("demonstration")


def top_entropy_tokens(entropy: torch.Tensor, selectable: torch.Tensor, keep: float) -> torch.Tensor:
    """Per row of [B, T] ``entropy``, the ``selectable`` tokens among the highest-entropy share
    ``keep`` of that row's selectable tokens: the lowest int(n * (1 - keep)) of a row's n are left
    out (the code's split point, so a short prefix keeps at least one token when keep > 0). Ties
    go to the later token (a stable sort). A bool mask like ``entropy``."""
    out = torch.zeros_like(selectable, dtype=torch.bool)
    for row in range(entropy.size(0)):
        where = selectable[row].nonzero().flatten()
        if not len(where):
            continue
        order = torch.sort(entropy[row, where].detach(), stable=True).indices
        out[row, where[order[int(len(where) * (1 - keep)) :]]] = True
    return out


@dataclass(frozen=True, kw_only=True)
class PrefixPolicyTerm(PolicyTerm):
    """The clipped surrogate with the advantages of a prefix's low-entropy tokens zeroed (see the
    module's docstring). ``keep``: the share of each prefix's tokens, by entropy, that train."""

    kind = "policy"
    keep: float = 0.2
    clip_prefix: bool = True

    def needs(self) -> tuple[str, ...]:
        # the entropy only ranks tokens: read, never differentiated (the forward computes it without a graph)
        return (*super().needs(), "entropy")

    def token_loss(self, f, b, mask, m):
        prefix = (b["origin"] == DEMONSTRATION) & (mask > 0)
        kept = top_entropy_tokens(f["entropy"], prefix, self.keep)
        adv = b["advantages"] * (~prefix | kept)
        tok = super().token_loss(f, {**b, "advantages": adv}, mask, m)
        with torch.no_grad():
            m.mean("prefix_kept", kept.float(), prefix)
        if self.clip_prefix:
            return tok
        old = f["logprobs"].detach() if self.old == "self" else b["old_logprobs"]
        return torch.where(prefix, -adv * torch.exp(f["logprobs"] - old), tok)
