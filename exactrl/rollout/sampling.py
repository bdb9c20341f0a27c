"""The draw of a sampled token, keyed per response: Hugging Face's sampling distribution
(temperature, then top-k, then top-p), sampled by inverting its CDF at a uniform that depends only
on the response's seed and the step, so no batch, rank or batch size changes a rollout
(exactrl/rollout/generator.py: prompt_seeds, row_seed). The decode loop and the ``generate``
fallback (exactrl/rollout/hf.py) both draw here."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from exactrl.losses.token_losses import kept_set


def warp(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's sampling distribution from fp32 logits [rows, vocab]: temperature, then
    top-k (ties with the k-th score stay in), then top-p keeping at least one token
    (exactrl/losses/token_losses.py kept_set, which the trainer replays). Returns the cut scores
    and log p at the temperature before the cuts, as the loss computes it (the HF loop's
    convention, exactrl/rollout/generator.py: the kept set shapes the draws, not the log-probs)."""
    scores = logits / temperature
    logp = torch.log_softmax(scores, dim=-1)
    if top_p < 1.0 or 0 < top_k < scores.shape[-1]:
        scores = scores.masked_fill(~kept_set(scores, top_p, top_k), float("-inf"))
    return scores, logp


def draw(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float, top_k: int = 0,
          uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next tokens from fp32 logits [rows, vocab], greedy or drawn from ``warp``'s distribution
    by inverting its CDF at each row's ``uniform`` in [0, 1) (one multinomial draw, keyed by the
    row rather than by a shared stream); with the log-prob of each drawn token. The CDF is
    summed in float64 so that u * total stays below the total: a token outside the kept set
    (probability 0) is never picked."""
    if greedy:
        return logits.argmax(-1), None
    scores, logp = warp(logits, temperature, top_p, top_k)
    cdf = torch.softmax(scores, dim=-1).double().cumsum(-1)
    token = torch.searchsorted(cdf, uniform.double()[:, None] * cdf[:, -1:], right=True)[:, 0]
    return token, logp.gather(1, token[:, None])[:, 0]


def uniforms(seeds: list[int], steps: int, device) -> torch.Tensor:
    """[rows, steps] uniforms in [0, 1): row r's from a generator seeded ``seeds[r]``, step t's in
    column t. Drawn once per batch on the CPU (the same numbers on any device), so a row's draw
    at step t depends on its seed and t alone: not on its batch, its place in it, or on which
    rows have left it."""
    return torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(device)


class KeyedDraw(LogitsProcessor):
    """Inside a greedy ``generate``: leaves only the token ``draw`` picks from row r's uniform at
    this step (the step counted from the prompt width), so the argmax is the keyed draw."""

    def __init__(self, u: torch.Tensor, width: int, temperature: float, top_p: float, top_k: int):
        self.u, self.width, self.temperature, self.top_p, self.top_k = u, width, temperature, top_p, top_k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token, _ = draw(scores.float(), False, self.temperature, self.top_p, self.top_k,
                         self.u[:, input_ids.shape[1] - self.width])
        return torch.full_like(scores, float("-inf")).scatter(1, token[:, None], 0.0)
