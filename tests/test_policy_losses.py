"""Policy and value losses against values computed by hand, and GSPO's per-token form against
its sequence-level definition written out directly (value and gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.losses import aggregate
from exactrl.losses.aggregation import StepNormalizer
from exactrl.losses.policy import POLICY_LOSSES, PolicyInput, get_policy_loss, value_loss
from exactrl.losses.token_losses import kl_penalty


def lp(*ratios):
    """Log-probs whose ratio to old log-probs of 0 are the given ratios."""
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)


def test_ppo_clip_by_hand_with_clip_higher():
    ratios = (1.5, 1.25, 0.5, 0.9, 0.5)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    x = PolicyInput(lp(*ratios), torch.zeros(1, 5, dtype=torch.float64), adv, torch.ones(1, 5), clip_low=0.2,
                    clip_high=0.28)
    loss, ratio, clipped = get_policy_loss("ppo")(x)
    # A>0: min(r, clip(r)) -> 1.28 for r=1.5 (clip-higher bound), 1.25 unclipped; r=0.5 with A>0 stays 0.5.
    # A<0: -max(r, clip(r)) -> r=0.5 is raised to 0.8 (clip-low bound); r=0.9 unclipped.
    assert loss[0].tolist() == pytest.approx([-1.28, -1.25, 0.8, 0.9, -0.5], rel=1e-12)
    assert ratio[0].tolist() == pytest.approx(list(ratios), rel=1e-12)
    assert clipped[0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def sequence_level_gspo(logprobs, old, adv, mask, lo, hi):
    """GSPO as the paper writes it: one ratio per sequence, clipped objective per sequence, mean over sequences."""
    total = 0.0
    for i in range(logprobs.size(0)):
        m = mask[i] > 0
        s = torch.exp((logprobs[i][m] - old[i][m]).mean())
        a = adv[i, 0]
        total = total - torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a)
    return total / logprobs.size(0)


def test_gspo_per_token_form_equals_the_sequence_level_objective_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    # sequence 0 near on-policy, 1 far above 1 + clip_high, 2 far below 1 - clip_low
    shift = torch.tensor([[0.01], [0.6], [-0.6]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [1.0], [-1.0]], dtype=torch.float64)
    base = (old + shift + 0.05 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    loss, _, clipped = get_policy_loss("gspo")(PolicyInput(base, old, adv, mask, 0.2, 0.3))
    # seq-mean-token-mean over the 3 sequences: each token carries its sequence's loss
    got = aggregate(loss, mask, StepNormalizer("seq-mean-token-mean", num_tokens=int(mask.sum()), num_seqs=3,
                                               norm_len=4))
    (grad_got,) = torch.autograd.grad(got, base)
    base2 = base.detach().clone().requires_grad_()
    want = sequence_level_gspo(base2, old, adv, mask, 0.2, 0.3)
    (grad_want,) = torch.autograd.grad(want, base2)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(grad_got * mask, grad_want * mask, rtol=1e-10, atol=1e-14)
    assert clipped[:, 0].tolist() == [0.0, 1.0, 1.0]  # the two far-off sequences are clipped whole
    assert torch.all(grad_got[1:] == 0)  # ...and get no gradient


def test_reinforce_gradient_on_policy_is_minus_advantage_times_grad_logp():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ids = torch.tensor([[1, 2, 3], [4, 0, 1]])
    logp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    adv = torch.tensor([[0.7], [-1.3]], dtype=torch.float64)
    loss, ratio, _ = get_policy_loss("reinforce")(PolicyInput(logp, logp.detach(), adv, torch.ones(2, 3)))
    (g_loss,) = torch.autograd.grad(loss.sum(), logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad(-(adv * logp).sum(), logits)
    assert torch.allclose(ratio, torch.ones_like(ratio)) and torch.allclose(g_loss, g_ref, rtol=1e-12)


def test_value_loss_by_hand():
    values = torch.tensor([1.0, 0.0, 2.0])
    old = torch.tensor([0.5, 0.5, 0.5])
    returns = torch.tensor([2.0, 1.0, 0.0])
    assert value_loss(values, old, returns, None).tolist() == pytest.approx([0.5, 0.5, 2.0])
    # clip 0.2: clipped values 0.7, 0.3, 0.7 -> squared errors 1.69, 0.49, 0.49; max with 1, 1, 4
    assert value_loss(values, old, returns, 0.2).tolist() == pytest.approx([0.845, 0.5, 2.0])


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # r = p_ref / p = 0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    with pytest.raises(ValueError, match="choose k1, k2 or k3"):
        kl_penalty(logp, ref, "k4")


def test_registry():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "reinforce"}
    with pytest.raises(ValueError, match="unknown policy loss 'clip'; choose one of gspo, ppo, reinforce"):
        get_policy_loss("clip")


def dual_clip_by_the_paper(r: float, a: float, eps: float, c: float) -> float:
    """Ye et al. 2020 (arXiv 1912.09729), eq. 5: for A < 0, max(min(r A, clip(r, 1-eps, 1+eps) A), c A);
    for A >= 0 the plain clipped objective. Returned as a loss (negated)."""
    clipped = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    return -(max(clipped, c * a) if a < 0 else clipped)


def test_dual_clip_ppo_against_the_paper():
    ratios = (5.0, 3.5, 2.0, 0.5, 5.0, 1.0)
    advs = (-1.0, -2.0, -1.0, -1.0, 1.0, -0.5)
    adv = torch.tensor([advs], dtype=torch.float64)
    x = PolicyInput(lp(*ratios), torch.zeros(1, 6, dtype=torch.float64), adv, torch.ones(1, 6), 0.2, 0.2, dual_clip=3.0)
    loss, _, clipped = get_policy_loss("ppo")(x)
    expected = [dual_clip_by_the_paper(r, a, 0.2, 3.0) for r, a in zip(ratios, advs)]
    # r=5, A=-1: PPO alone gives 5 (unbounded in r); dual-clip caps it at c |A| = 3; r=3.5, A=-2: 7 -> 6
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-12) and loss[0, :2].tolist() == pytest.approx([3.0, 6.0])
    assert clipped[0].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    logp = lp(*ratios).requires_grad_()
    get_policy_loss("ppo")(PolicyInput(logp, torch.zeros(1, 6, dtype=torch.float64), adv, torch.ones(1, 6),
                                       dual_clip=3.0))[0].sum().backward()
    assert logp.grad[0, :2].tolist() == [0.0, 0.0]  # the bound c A does not depend on the policy
    off, _, _ = get_policy_loss("ppo")(PolicyInput(lp(*ratios), torch.zeros(1, 6, dtype=torch.float64), adv,
                                                   torch.ones(1, 6)))
    assert off[0, 0].item() == pytest.approx(5.0)  # without it, as before
