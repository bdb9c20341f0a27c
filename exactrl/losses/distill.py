"""Distillation divergences between a teacher's and a student's next-token distributions. Pure per-token
functions: logits [..., V] in, one value per position [...] out, never reduced over tokens or sequences (the
step's one normaliser does that, docs/concepts.md). Computed in fp32 at least (half-precision logits are
upcast, float64 ones are kept). The teacher's side carries no gradient (it is detached here).

Conventions, with p_T and p_S the teacher's and student's softmax(logits / temperature) over the vocabulary:

- ``forward_kl``   KL(p_T || p_S) = sum_v p_T log(p_T / p_S): supervised KD's divergence (Hinton et al. 2015;
  mode-covering). OpenRLHF's KDLoss (openrlhf/models/loss.py, after MiniLLM) computes -sum_v p_T log p_S, the
  cross-entropy: the same gradient, offset by the teacher's entropy, which it never reports as a divergence.
- ``reverse_kl``   KL(p_S || p_T) = sum_v p_S log(p_S / p_T): mode-seeking (MiniLLM, Gu et al. 2024).
- ``generalized_jsd``   GKD's JSD(beta) (Agarwal et al. 2024, arXiv 2306.13649, eq. 1) as TRL writes it
  (trl/experimental/gkd/gkd_trainer.py ``generalized_jsd_loss``): M = beta p_T + (1 - beta) p_S,
  JSD(beta) = beta KL(p_T || M) + (1 - beta) KL(p_S || M). TRL defines the two ends as the KLs themselves:
  beta = 0 gives KL(p_T || p_S) (forward), beta = 1 gives KL(p_S || p_T) (reverse). Those are the limits of
  JSD(beta) / beta as beta -> 0 and of JSD(beta) / (1 - beta) as beta -> 1, not of JSD(beta), which goes to
  0 at both ends: the ends are a change of scale, kept here because every peer's config means them so.
- ``topk_forward_kl``   forward KL to the teacher's top-k tokens, the teacher renormalised over them:
  p~_T = p_T / m_T on the top-k (m_T = their teacher mass), KL(p~_T || p_S) = sum_{i in top-k} p~_T(i)
  log(p~_T(i) / p_S(i)), p_S over the whole vocabulary. A proper KL (>= 0, 0 iff p_S = p~_T). verl's
  ``forward_kl_topk`` (verl/trainer/distillation/fsdp/losses.py ``compute_forward_kl_topk``) does not
  renormalise: sum_{top-k} p_T log(p_T / p_S) = m_T (KL(p~_T || p_S) + log m_T), the same minimiser and
  m_T times the gradient, but not >= 0 and 0 when p_S = p_T; ``renormalize=False`` gives that form.
- ``reverse_kl_k1`` / ``reverse_kl_k3``: the per-token estimators of KL(p_S || p_T) from the student's own
  sampled token y (on-policy distillation), on per-token log-probs (Schulman, "Approximating KL divergence",
  2020; Thinking Machines' on-policy distillation uses k1 as a per-token negative advantage, verl's
  ``kl_penalty`` offers both): k1 = log p_S(y) - log p_T(y); k3 = (r - 1) - log r with r = p_T(y) / p_S(y).
  Both are unbiased for the reverse KL over y ~ p_S; k3 >= 0. Their *gradients* differ from the reverse KL's:
  E_y[grad k1] = sum_y p_S grad log p_S = 0, so k1 trains only as a reward or advantage (policy gradient);
  E_y[grad k3] = sum_y (p_S - p_T) grad log p_S = grad KL(p_T || p_S), the forward KL's gradient.

Temperature: the logits are divided by it before the softmax, on both sides, as TRL's
``generalized_jsd_loss`` does; no T^2 factor (Hinton's, restoring gradient scale at high T) is applied:
scale the term's coefficient instead. The sampled-token estimators take log-probs already computed at the
rollout's temperature (losses/token_losses.py ``token_logprobs``).
"""

from __future__ import annotations

import math

import torch

from exactrl.losses.token_losses import at_least_fp32, kl_penalty

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "topk_forward_kl")


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.to(at_least_fp32(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_v p (log p - log q) over the last dimension, with 0 log 0 = 0 (a token p gives no mass adds nothing,
    even where q is 0 too, as F.kl_div's xlogy does)."""
    p = log_p.exp()
    # where() on the log-ratio, not on the product: the product's unused branch would send 0 * inf = nan back
    return (p * torch.where(p > 0, log_p - log_q, torch.zeros_like(p))).sum(-1)


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_T || p_S) = sum_v p_T(v) log(p_T(v) / p_S(v)) at each position [...] (Hinton et al. 2015)."""
    return _kl(_log_softmax(teacher_logits.detach(), temperature), _log_softmax(student_logits, temperature))


def reverse_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_S || p_T) = sum_v p_S(v) log(p_S(v) / p_T(v)) at each position [...] (MiniLLM, Gu et al. 2024)."""
    return _kl(_log_softmax(student_logits, temperature), _log_softmax(teacher_logits.detach(), temperature))


def generalized_jsd(teacher_logits: torch.Tensor, student_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """GKD's generalised JSD (Agarwal et al. 2024, arXiv 2306.13649, eq. 1; TRL GKDTrainer.generalized_jsd_loss):
    M = beta p_T + (1 - beta) p_S, beta KL(p_T || M) + (1 - beta) KL(p_S || M) at each position. As TRL:
    beta = 0 is KL(p_T || p_S) (forward), beta = 1 is KL(p_S || p_T) (reverse) -- see the module docstring."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must lie in [0, 1], got {beta}")
    log_t = _log_softmax(teacher_logits.detach(), temperature)
    log_s = _log_softmax(student_logits, temperature)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    # a token both rule out (-inf logits: a masked vocabulary): logaddexp(-inf, -inf)'s gradient is nan, and
    # log M there is never read (p_T = p_S = 0 weigh it), so any finite stand-in does
    dead = (log_t == float("-inf")) & (log_s == float("-inf"))
    log_m = torch.logaddexp(log_t.masked_fill(dead, 0.0) + math.log(beta),
                            log_s.masked_fill(dead, 0.0) + math.log1p(-beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def topk_forward_kl_from_logprobs(teacher_topk_logprobs: torch.Tensor, teacher_topk_ids: torch.Tensor,
                                  student_logits: torch.Tensor, temperature: float = 1.0,
                                  renormalize: bool = True) -> torch.Tensor:
    """Forward KL to the teacher's top-k tokens, from what a teacher engine returns: its log-probs over the
    whole vocabulary of its k most likely tokens [..., k] and their ids [..., k] (already at ``temperature``);
    the student's logits [..., V] are divided by ``temperature`` here. ``renormalize`` (the default):
    KL(p~_T || p_S) with p~_T the teacher renormalised over its top-k; False: verl's forward_kl_topk,
    sum_{top-k} p_T (log p_T - log p_S) (module docstring)."""
    log_s = _log_softmax(student_logits, temperature).gather(-1, teacher_topk_ids)
    log_t = teacher_topk_logprobs.detach().to(log_s.dtype)
    if renormalize:
        log_t = log_t - log_t.logsumexp(-1, keepdim=True)
    return _kl(log_t, log_s)


def topk_forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, k: int, temperature: float = 1.0,
                    renormalize: bool = True) -> torch.Tensor:
    """``topk_forward_kl_from_logprobs`` on the teacher's k most likely tokens at ``temperature`` (torch.topk: of
    tied logits at the boundary, the lower ids)."""
    if k < 1:
        raise ValueError(f"topk_forward_kl: k must be at least 1, got {k}")
    log_t = _log_softmax(teacher_logits.detach(), temperature)
    top, ids = log_t.topk(min(k, log_t.shape[-1]), dim=-1)
    return topk_forward_kl_from_logprobs(top, ids, student_logits, temperature, renormalize)


def reverse_kl_k1(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log p_S(y) - log p_T(y) per sampled token (Schulman 2020): unbiased for KL(p_S || p_T) over y ~ p_S,
    can be negative; its expected gradient is 0 (train it as a reward/advantage, Thinking Machines' OPD)."""
    return kl_penalty(student_logprobs, teacher_logprobs.detach(), "k1")


def reverse_kl_k3(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r, r = p_T(y) / p_S(y), per sampled token (Schulman 2020): unbiased for KL(p_S || p_T)
    over y ~ p_S and >= 0; its expected gradient is that of KL(p_T || p_S) (module docstring)."""
    return kl_penalty(student_logprobs, teacher_logprobs.detach(), "k3")


def divergence(name: str, teacher_logits: torch.Tensor, student_logits: torch.Tensor, *, temperature: float = 1.0,
               beta: float = 0.5, top_k: int = 0) -> torch.Tensor:
    """The full-distribution divergence ``name`` (one of DIVERGENCES) at each position: what a distillation term
    of the objective calls with its declared knobs."""
    if name == "forward_kl":
        return forward_kl(teacher_logits, student_logits, temperature)
    if name == "reverse_kl":
        return reverse_kl(teacher_logits, student_logits, temperature)
    if name == "jsd":
        return generalized_jsd(teacher_logits, student_logits, beta, temperature)
    if name == "topk_forward_kl":
        return topk_forward_kl(teacher_logits, student_logits, top_k, temperature)
    raise ValueError(f"unknown distillation divergence '{name}'; choose one of {', '.join(DIVERGENCES)}")
