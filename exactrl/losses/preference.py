"""Preference losses: pure per-pair functions in a registry keyed by name (the DPO family, SimPO, ORPO,
the reward model's Bradley-Terry loss), and KTO's unpaired loss with its reference point.

Nothing here reduces over pairs. A pair loss returns one value per pair; the step's one normaliser
(the number of pairs in the whole step, every micro-batch and rank) turns them into the step's loss,
so the update does not depend on how pairs were split (docs/algorithms/preference.md). The peers take
a mean over each micro-batch's pairs instead, which is exact only when every micro-batch holds the
same number of pairs.

Inputs are per-sequence sums of log-probs over each answer's loss tokens, with the token counts, so a
loss that wants the length-normalised (average) log-prob divides here and nowhere else.

Where a peer defines the convention, the function matches it (tests/test_preference_losses.py holds
the peers' formulas, read from huggingface/trl at f2cd5771 and OpenRLHF/OpenRLHF at 3c3be623):
- dpo (sigmoid) and robust: TRL trl/trainer/dpo_trainer.py lines 1434-1435 and 1475-1478; dpo with
  label_smoothing (cDPO): OpenRLHF openrlhf/models/loss.py lines 325-329.
- ipo: TRL length-normalises the log-ratios (dpo_trainer.py lines 1440-1451: each answer's summed
  log-ratio divided by completion_mask.sum()); OpenRLHF sums them (loss.py lines 322-323 applied to
  the sums openrlhf/trainer/dpo_trainer.py lines 322-324 pass in). ``ipo_length_normalized`` picks.
- simpo: TRL trl/experimental/cpo/cpo_trainer.py lines 714-721 (average log-probs, line 849).
- orpo: TRL trl/experimental/orpo/orpo_trainer.py lines 88-92 and 693-700 (average log-probs, line 808).
- bt: TRL trl/trainer/reward_trainer.py lines 750-756; OpenRLHF loss.py lines 272-284 (PairWiseLoss).
- KTO: TRL trl/trainer/kto_trainer.py lines 1553-1576.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from exactrl.registry import Registry


@dataclass(frozen=True)
class PairInput:
    """One row per preference pair ([P] tensors), never reduced over pairs here."""

    chosen: Tensor  # the policy's log-prob of each pair's chosen answer: sum over its loss tokens (bt: its reward)
    rejected: Tensor  # the same for the rejected answer
    chosen_tokens: Tensor  # number of loss tokens of the chosen answer (unused by bt)
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None  # the reference model's sums; None for reference-free losses
    ref_rejected: Tensor | None = None
    margin: Tensor | None = None  # a per-pair margin column (reward model data); None: 0


@dataclass(frozen=True)
class PairParams:
    """Every knob of the pair losses. Defaults are the papers' (DPO's beta); where one loss's paper
    uses another value of a shared knob, its registry entry says so in ``paper_params``."""

    # DPO's beta (Rafailov et al. 2023), IPO's tau (Azar et al. 2023), SimPO's beta (the SimPO paper
    # uses 2 to 10: its registry entry carries 2.0, the official repository's default).
    beta: float = 0.1
    # epsilon: dpo -> conservative DPO's label noise (cDPO, Mitchell 2023), robust -> robust DPO's flip
    # rate (must be < 0.5), simpo -> the same smoothing TRL's CPO trainer and SimPO's repository apply.
    label_smoothing: float = 0.0
    # SimPO's target reward margin gamma, ABSOLUTE as in the paper's eq. (6): -log sigma(beta*avg_c -
    # beta*avg_r - gamma). TRL's simpo_gamma is the same (default 0.5); SimPO's repository sets the
    # ratio gamma/beta instead (gamma_beta_ratio 0.25 at beta 2.0, i.e. gamma = 0.5).
    gamma: float = 0.5
    # IPO on per-token (average) log-ratios, as TRL does and the IPO authors confirmed to TRL their
    # results used (dpo_trainer.py's comment at lines 1441-1445); False sums them, as OpenRLHF does.
    ipo_length_normalized: bool = True
    # ORPO's lambda, the odds-ratio term's weight beside the NLL (Hong et al. 2024; TRL's ORPOConfig.beta).
    orpo_lambda: float = 0.1
    # bt: coefficient of (r_c + r_r)^2, which centres rewards on 0 (Eisenstein et al. 2023, arXiv
    # 2312.09244; TRL's center_rewards_coefficient, off by default, 0.01 in its docs' example).
    center_rewards: float = 0.0

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5], got {self.label_smoothing}")
        if not self.orpo_lambda >= 0 or not self.center_rewards >= 0:
            raise ValueError(f"orpo_lambda and center_rewards must be >= 0, got {self.orpo_lambda}, "
                             f"{self.center_rewards}")


PairFn = Callable[[PairInput, PairParams], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PairLoss:
    fn: PairFn  # (PairInput, PairParams) -> (loss per pair [P], {"chosen_reward": [P], "rejected_reward": [P], ...})
    needs_reference: bool  # reads ref_chosen / ref_rejected (a reference worker, or cached reference sums)
    paper: str
    peers: str  # which peer computes the same per-pair value, and under which setting
    uses: tuple[str, ...] = ()  # the PairParams knobs it reads: a config may refuse any other it was given
    paper_params: dict[str, float] = field(default_factory=dict)  # the paper's values where not PairParams'


PAIR_LOSSES: Registry[PairLoss] = Registry("pair loss")


def pair_loss(name: str, *, needs_reference: bool, paper: str, peers: str, uses: tuple[str, ...] = (),
              **paper_params: float):
    def add(fn: PairFn) -> PairFn:
        PAIR_LOSSES.add(name, PairLoss(fn, needs_reference, paper, peers, uses, paper_params))
        return fn

    return add


def _log_ratios(x: PairInput, name: str) -> tuple[Tensor, Tensor]:
    """log pi(y|x) - log pi_ref(y|x) of each answer, summed over its loss tokens."""
    if x.ref_chosen is None or x.ref_rejected is None:
        raise ValueError(f"pair loss '{name}' needs the reference model's log-probs (ref_chosen, ref_rejected)")
    return x.chosen - x.ref_chosen, x.rejected - x.ref_rejected


def _per_token(values: Tensor, tokens: Tensor, name: str) -> Tensor:
    """A sum over an answer's loss tokens divided by their number. TRL clamps an empty answer's count
    to 1; here an answer with no loss token is an error (its average is undefined), to be fixed in
    the data (a prompt that filled the whole length budget)."""
    if bool((tokens < 1).any()):
        raise ValueError(f"pair loss '{name}' length-normalises, but a pair has an answer with no loss tokens "
                         "(chosen_tokens or rejected_tokens is 0): drop the pair or shorten its prompt")
    return values / tokens.to(values.dtype)


def _no_margin(x: PairInput, name: str) -> None:
    # a margin column given to a loss that has no place for it would otherwise be silently ignored
    if x.margin is not None:
        raise ValueError(f"pair loss '{name}' takes no margin column; only 'bt' (the reward model's loss) does")


def _smoothed(z: Tensor, eps: float) -> Tensor:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the logistic loss on a label flipped with probability eps."""
    loss = -F.logsigmoid(z)
    return loss if eps == 0 else (1 - eps) * loss - eps * F.logsigmoid(-z)


def _rewards(chosen: Tensor, rejected: Tensor, **more: Tensor) -> dict[str, Tensor]:
    return {"chosen_reward": chosen.detach(), "rejected_reward": rejected.detach(),
            **{k: v.detach() for k, v in more.items()}}


@pair_loss("dpo", needs_reference=True, uses=("beta", "label_smoothing"),
           paper="Rafailov et al. 2023, arXiv 2305.18290, eq. 7; label_smoothing > 0: conservative DPO "
                 "(Mitchell 2023, 'A note on DPO with noisy preferences')",
           peers="TRL DPOTrainer loss_type='sigmoid' (no label smoothing); OpenRLHF DPOLoss (label_smoothing)")
def dpo(x: PairInput, p: PairParams):
    """-log sigma(beta h), h = (log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected), sums over
    tokens; with label_smoothing eps, conservative DPO: the same loss on a label flipped with probability
    eps, (1 - eps) l(h) + eps l(-h)."""
    _no_margin(x, "dpo")
    chosen, rejected = _log_ratios(x, "dpo")
    return _smoothed(p.beta * (chosen - rejected), p.label_smoothing), _rewards(p.beta * chosen, p.beta * rejected)


@pair_loss("robust", needs_reference=True, uses=("beta", "label_smoothing"), label_smoothing=0.1,
           paper="Chowdhury et al. 2024, arXiv 2403.00409 (rDPO)",
           peers="TRL DPOTrainer loss_type='robust' (label_smoothing = the flip rate)")
def robust(x: PairInput, p: PairParams):
    """Robust DPO: the unbiased estimator of the clean-label loss when labels flip with probability
    eps, ((1 - eps) l(h) - eps l(-h)) / (1 - 2 eps) with l(h) = -log sigma(beta h). It can be negative,
    which is why eps must stay below 0.5 (the paper's 0.1 is its registry value)."""
    _no_margin(x, "robust")
    eps = p.label_smoothing
    if not eps < 0.5:
        raise ValueError(f"robust DPO needs label_smoothing (the flip rate) < 0.5, got {eps}")
    chosen, rejected = _log_ratios(x, "robust")
    h = p.beta * (chosen - rejected)
    loss = ((1 - eps) * -F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    return loss, _rewards(p.beta * chosen, p.beta * rejected)


@pair_loss("ipo", needs_reference=True, uses=("beta", "ipo_length_normalized"),
           paper="Azar et al. 2023, arXiv 2310.12036, eq. 17",
           peers="TRL DPOTrainer loss_type='ipo' (ipo_length_normalized=True); OpenRLHF DPOLoss ipo=True "
                 "(ipo_length_normalized=False)")
def ipo(x: PairInput, p: PairParams):
    """(h - 1/(2 tau))^2 with tau = beta; h is the difference of the answers' log-ratios, per token
    (each answer's summed log-ratio over its own token count) or summed. Rewards are beta times the
    summed log-ratios either way (what TRL logs)."""
    _no_margin(x, "ipo")
    chosen, rejected = _log_ratios(x, "ipo")
    if p.ipo_length_normalized:
        h = _per_token(chosen, x.chosen_tokens, "ipo") - _per_token(rejected, x.rejected_tokens, "ipo")
    else:
        h = chosen - rejected
    return (h - 1 / (2 * p.beta)) ** 2, _rewards(p.beta * chosen, p.beta * rejected)


@pair_loss("simpo", needs_reference=False, uses=("beta", "gamma", "label_smoothing"), beta=2.0, gamma=0.5,
           paper="Meng et al. 2024, arXiv 2405.14734, eq. 6",
           peers="TRL CPOTrainer loss_type='simpo' (gamma = its simpo_gamma); SimPO's repository "
                 "(gamma = beta * gamma_beta_ratio)")
def simpo(x: PairInput, p: PairParams):
    """Reference-free: -log sigma(beta avg_c - beta avg_r - gamma), avg = the answer's log-prob per loss
    token. Rewards are beta * avg (what TRL's CPO trainer logs)."""
    _no_margin(x, "simpo")
    chosen = p.beta * _per_token(x.chosen, x.chosen_tokens, "simpo")
    rejected = p.beta * _per_token(x.rejected, x.rejected_tokens, "simpo")
    return _smoothed(chosen - rejected - p.gamma, p.label_smoothing), _rewards(chosen, rejected)


def log1mexp(a: Tensor) -> Tensor:
    """log(1 - exp(a)) for a < 0, without cancellation: log(-expm1(a)) near 0, log1p(-exp(a)) below -ln 2
    (Maechler 2012, 'Accurately computing log(1 - exp(-|a|))')."""
    return torch.where(a > -math.log(2), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


@pair_loss("orpo", needs_reference=False, uses=("orpo_lambda",),
           paper="Hong et al. 2024, arXiv 2403.07691, eqs. 4-7",
           peers="TRL ORPOTrainer (orpo_lambda = its beta)")
def orpo(x: PairInput, p: PairParams):
    """ORPO's odds-ratio term, lambda * -log sigma(log(odds_c / odds_r)), where odds(y) = P / (1 - P) and
    P = exp(avg log-prob per loss token), so log odds = avg - log(1 - exp(avg)).

    ORPO's other half, the NLL of the chosen answer, is a token-level term: the objective adds it
    separately (an SFT term over the chosen answers' tokens with the step's token normaliser); it is not
    in this per-pair value. Rewards are lambda * avg (what TRL logs); ``log_odds`` is the per-pair log
    odds ratio."""
    _no_margin(x, "orpo")
    chosen = _per_token(x.chosen, x.chosen_tokens, "orpo")
    rejected = _per_token(x.rejected, x.rejected_tokens, "orpo")
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    lam = p.orpo_lambda
    return -lam * F.logsigmoid(log_odds), _rewards(lam * chosen, lam * rejected, log_odds=log_odds)


@pair_loss("bt", needs_reference=False, uses=("center_rewards",),
           paper="Bradley and Terry 1952; as a reward-model loss Ouyang et al. 2022, arXiv 2203.02155, eq. 1; "
                 "margin: Touvron et al. 2023, arXiv 2307.09288, eq. 2; centring: Eisenstein et al. 2023, "
                 "arXiv 2312.09244",
           peers="TRL RewardTrainer (margin column, center_rewards_coefficient); OpenRLHF PairWiseLoss (margin)")
def bt(x: PairInput, p: PairParams):
    """The reward model's loss: chosen/rejected are the scalar rewards r_c, r_r (token counts unused),
    -log sigma(r_c - r_r - margin) + center_rewards * (r_c + r_r)^2."""
    diff = x.chosen - x.rejected
    if x.margin is not None:
        diff = diff - x.margin
    loss = -F.logsigmoid(diff)
    if p.center_rewards:
        loss = loss + p.center_rewards * (x.chosen + x.rejected) ** 2
    return loss, _rewards(x.chosen, x.rejected)


def get_pair_loss(name: str) -> PairLoss:
    return PAIR_LOSSES.lookup(name)


# KTO (Ethayarajh et al. 2024, arXiv 2402.01306): unpaired rows, each desirable or undesirable, judged
# against a reference point z, the policy's KL to the reference estimated on mismatched pairs (a prompt
# with another row's completion). z is detached, so it is a batch statistic: computed over the whole
# step (a no-grad pre-pass), the objective does not depend on micro-batch size or world size. TRL takes
# each micro-batch's mean (gathered over ranks: kto_trainer.py lines 1553-1554), so its objective does.


def kto_reference_point(kl_policy: Tensor, kl_ref: Tensor) -> Tensor:
    """z = max(0, mean(kl_policy - kl_ref)) over the rows given (pass the whole step's mismatched pairs;
    at world size > 1, all-reduce the sum and count first). kl_* are per-row log-prob sums. No gradient."""
    if kl_policy.shape != kl_ref.shape or kl_policy.numel() == 0:
        raise ValueError(f"KTO's reference point needs matching, non-empty KL rows, got {tuple(kl_policy.shape)} "
                         f"and {tuple(kl_ref.shape)}")
    with torch.no_grad():
        return (kl_policy - kl_ref).mean().clamp(min=0)


def kto_losses(policy: Tensor, ref: Tensor, desirable: Tensor, z: Tensor | float, beta: float = 0.1,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Tensor:
    """Per-row KTO loss [N] (the paper's lambda_y - v(x, y)): with r = policy - ref (sums over
    each completion's loss tokens), desirable rows w_d (1 - sigma(beta (r - z))), undesirable rows
    w_u (1 - sigma(beta (z - r))). The paper's defaults: beta 0.1, weights 1 (when desirable and
    undesirable rows are balanced; it bounds w_d n_d / (w_u n_u) in [1, 4/3])."""
    if desirable.dtype != torch.bool or desirable.shape != policy.shape:
        raise ValueError("kto_losses: desirable must be a bool tensor shaped like policy")
    r = policy - ref
    z = torch.as_tensor(z, dtype=r.dtype, device=r.device).detach()
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - r)))
    return torch.where(desirable, good, bad)
