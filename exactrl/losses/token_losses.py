"""Per-token losses. Pure functions: [batch, time] in, [batch, time] out, never reduced.

Positions are aligned with *targets*: for input ids x[0..L), logits at position t predict
x[t+1], so every tensor here has length L-1 and ``mask`` marks targets that count.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                   chunk: int = 0) -> torch.Tensor:
    """log p(x[t+1] | x[..t]) for every position, at ``temperature`` (logits are divided by it,
    matching how the rollout engine sampled). Computed in fp32 at least: half-precision logits
    are upcast, float64 ones (the equivalence tests' models) are not rounded down.
    ``chunk`` > 0: at most that many positions at a time (see ``_by_chunks``)."""
    targets = input_ids[:, 1:]
    return _by_chunks(partial(logprob_rows, temperature=temperature), logits[:, :-1], chunk,
                      targets).view(targets.shape)


def logprob_rows(rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` of logits rows [N, V] and their targets [N]."""
    rows = rows.to(at_least_fp32(rows.dtype))
    if temperature != 1.0:
        rows = rows / temperature
    # cross_entropy fuses log-softmax and gather without keeping a [N, V] log-prob tensor.
    return -F.cross_entropy(rows, targets, reduction="none")


def kept_set(scores: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Which tokens Hugging Face's sampling keeps from temperature-scaled scores [rows, vocab]:
    top-k first (ties with the k-th score stay in), then top-p over what is left, keeping the
    smallest set of most likely tokens whose probabilities add up to top_p and at least one
    (TopKLogitsWarper, TopPLogitsWarper). The decode loop draws from this set
    (exactrl/rollout/sampling.py) and the trainer replays it (``kept_logprobs``): one definition."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if 0 < top_k < scores.shape[-1]:
        keep = scores >= torch.topk(scores, top_k)[0][:, -1:]
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores.masked_fill(~keep, float("-inf")), descending=False)
        cut = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        cut[:, -1] = False
        keep = keep & ~cut.scatter(1, order, cut)
    return keep


def kept_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  chunk: int = 0) -> torch.Tensor:
    """log p(x[t+1] | x[..t]) under the sampling distribution renormalised over its top-k/top-p
    kept set (``kept_set``): what a generator that reports log-probs over the kept set returns
    (vLLM's logprobs_mode=processed_logprobs), replayed on the trainer's logits so a comparison
    is not off by the kept mass (TRL issue #6789, PR #7269). The target token always counts as
    kept: it was drawn from the generator's set, and a trainer whose logits put it just outside
    its own (a rounding tie at the boundary) would otherwise give it log 0 = -inf (prime-rl
    PR #2601 does the same). Computed in fp32 at least, ``chunk`` positions at a time."""
    targets = input_ids[:, 1:]
    return _by_chunks(partial(kept_rows, temperature=temperature, top_p=top_p, top_k=top_k), logits[:, :-1], chunk,
                      targets).view(targets.shape)


def kept_rows(rows: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """``kept_logprobs`` of logits rows [N, V] and their targets [N]."""
    scores = rows.to(at_least_fp32(rows.dtype)) / temperature
    keep = kept_set(scores, top_p, top_k)
    keep[torch.arange(len(keep), device=keep.device), targets] = True
    logp = scores.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return logp.gather(1, targets[:, None])[:, 0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk: int = 0) -> torch.Tensor:
    """Entropy of the next-token distribution at each target position (for metrics)."""
    return _by_chunks(partial(entropy_rows, temperature=temperature), logits[:, :-1], chunk).view(logits.shape[0], -1)


def entropy_rows(rows: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``token_entropy`` of logits rows [N, V]."""
    logp = (rows.to(at_least_fp32(rows.dtype)) / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _by_chunks(fn, logits: torch.Tensor, chunk: int, targets: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` over the [B, T, V] ``logits`` as [N, V] rows, ``chunk`` rows at a time (0: all at
    once), so the fp32 copy and log-softmax of the whole micro-batch never exist together.
    Every row is computed by itself (log-softmax normalises over one row), so the values and,
    through split's backward (one gradient buffer, no sums), the gradients are bit-identical."""
    rows = logits.reshape(-1, logits.size(-1))
    args = [] if targets is None else [targets.reshape(-1)]
    if chunk <= 0 or rows.size(0) <= chunk:
        return fn(rows, *args)
    parts = zip(rows.split(chunk), *(a.split(chunk) for a in args))
    return torch.cat([fn(*p) for p in parts])


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token."""
    return -logprobs


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    With r = p_ref / p (Schulman, "Approximating KL divergence", 2020): k1 = -log r (unbiased,
    can be negative; the usual per-token KL in the reward), k2 = (log r)^2 / 2 (low variance,
    its gradient is that of the reverse KL), k3 = (r - 1) - log r (non-negative and unbiased,
    the GRPO paper's choice).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}'; choose k1, k2 or k3")


def _p_one_minus_p(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    p = fields["logprobs"].detach().exp()
    return p * (1 - p)


# Per-token weights a term of the objective may multiply its token loss by (Term.weight), each
# (the per-token fields it reads, the weight from them). Stop-gradient: a weight scales a token's
# gradient, its own derivative adds nothing.
TOKEN_WEIGHTS = {
    # SRFT (arXiv 2506.19767): sg(e^{-H}) on demonstration NLL, H the entropy of the policy's next-token distribution
    "exp_neg_entropy": (("entropy",), lambda fields: torch.exp(-fields["entropy"].detach())),
    # CHORD (arXiv 2508.11408): phi = p (1 - p), p the probability of the demonstrated token
    "p_one_minus_p": (("logprobs",), _p_one_minus_p),
    # SRFT (arXiv 2506.19767): sg(e^{H}) on the NLL of the policy's positive responses, so that training on
    # them (which lowers entropy) weighs more while entropy is high; its official code weighs the
    # demonstrations' NLL by it too
    "exp_entropy": (("entropy",), lambda fields: torch.exp(fields["entropy"].detach())),
}
