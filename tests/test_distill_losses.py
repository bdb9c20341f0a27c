"""The distillation divergences (exactrl/losses/distill.py) against independent computations: explicit loops
over the vocabulary in float64 Python arithmetic, torch.distributions' KL, the peers' formulas (TRL's
generalized_jsd_loss, verl's forward_kl_topk) written out by meaning, the analytic gradients, and the
sampled-token estimators' expectations (exactly, by enumerating the vocabulary, and by Monte Carlo)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from exactrl.losses.distill import (
    divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    reverse_kl_k1,
    reverse_kl_k3,
    topk_forward_kl,
    topk_forward_kl_from_logprobs,
)

TOL = dict(rel=1e-12, abs=1e-13)
V = 7


def logits_pair(seed: int, shape=(2, 3), scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, V, generator=g, dtype=torch.float64) * scale
    s = torch.randn(*shape, V, generator=g, dtype=torch.float64) * scale
    return t, s


def probs(row, temperature=1.0):
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    total = sum(e)
    return [x / total for x in e]


def kl_loop(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def rows(t):
    return t.reshape(-1, t.shape[-1]).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_forward_and_reverse_kl_against_loops_and_torch_distributions(temperature):
    t, s = logits_pair(0)
    fwd, rev = forward_kl(t, s, temperature), reverse_kl(t, s, temperature)
    assert fwd.shape == rev.shape == t.shape[:-1]
    for got_f, got_r, tr, sr in zip(fwd.flatten().tolist(), rev.flatten().tolist(), rows(t), rows(s)):
        pt, ps = probs(tr, temperature), probs(sr, temperature)
        assert got_f == pytest.approx(kl_loop(pt, ps), **TOL)
        assert got_r == pytest.approx(kl_loop(ps, pt), **TOL)
    ct, cs = Categorical(logits=t / temperature), Categorical(logits=s / temperature)
    torch.testing.assert_close(fwd, kl_divergence(ct, cs), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(rev, kl_divergence(cs, ct), rtol=1e-12, atol=1e-13)


def jsd_loop(pt, ps, beta):
    m = [beta * a + (1 - beta) * b for a, b in zip(pt, ps)]
    return beta * kl_loop(pt, m) + (1 - beta) * kl_loop(ps, m)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_against_the_paper_formula_and_trl(beta):
    t, s = logits_pair(1)
    got = generalized_jsd(t, s, beta, temperature=1.3)
    for g, tr, sr in zip(got.flatten().tolist(), rows(t), rows(s)):
        assert g == pytest.approx(jsd_loop(probs(tr, 1.3), probs(sr, 1.3), beta), **TOL)
    # TRL's generalized_jsd_loss (trl/experimental/gkd/gkd_trainer.py), by meaning: kl_div(input, target) is
    # KL(target || input), so kl_teacher is KL(p_T || M)
    lt, ls = F.log_softmax(t / 1.3, -1), F.log_softmax(s / 1.3, -1)
    b = torch.tensor(beta, dtype=torch.float64)
    mix = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), 0)
    trl = (b * F.kl_div(mix, lt, reduction="none", log_target=True)
           + (1 - b) * F.kl_div(mix, ls, reduction="none", log_target=True)).sum(-1)
    torch.testing.assert_close(got, trl, rtol=1e-12, atol=1e-14)


def test_generalized_jsd_ends_and_limits():
    t, s = logits_pair(2)
    # TRL's ends: beta = 0 is the forward KL(p_T || p_S), beta = 1 the reverse KL(p_S || p_T)
    torch.testing.assert_close(generalized_jsd(t, s, 0.0), forward_kl(t, s), rtol=0, atol=0)
    torch.testing.assert_close(generalized_jsd(t, s, 1.0), reverse_kl(t, s), rtol=0, atol=0)
    # which are the limits of JSD(beta)/beta and JSD(beta)/(1 - beta), not of JSD(beta) (that goes to 0)
    eps = 1e-7
    torch.testing.assert_close(generalized_jsd(t, s, eps) / eps, forward_kl(t, s), rtol=1e-5, atol=0)
    torch.testing.assert_close(generalized_jsd(t, s, 1 - eps) / eps, reverse_kl(t, s), rtol=1e-5, atol=0)
    # JSD(1/2) is symmetric, and beta <-> 1 - beta swaps the roles
    torch.testing.assert_close(generalized_jsd(t, s, 0.5), generalized_jsd(s, t, 0.5), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(generalized_jsd(t, s, 0.3), generalized_jsd(s, t, 0.7), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="beta must lie in"):
        generalized_jsd(t, s, 1.5)


def test_topk_forward_kl_renormalised_against_loops_and_verl_form():
    t, s = logits_pair(3)
    k, temperature = 3, 0.8
    ours = topk_forward_kl(t, s, k, temperature)
    verl = topk_forward_kl(t, s, k, temperature, renormalize=False)
    for o, v, tr, sr in zip(ours.flatten().tolist(), verl.flatten().tolist(), rows(t), rows(s)):
        pt, ps = probs(tr, temperature), probs(sr, temperature)
        top = sorted(range(V), key=lambda i: -pt[i])[:k]
        mass = sum(pt[i] for i in top)
        assert o == pytest.approx(sum(pt[i] / mass * math.log(pt[i] / mass / ps[i]) for i in top), **TOL)
        # verl's compute_forward_kl_topk: the teacher's full-vocabulary log-probs of its top-k, not renormalised
        assert v == pytest.approx(sum(pt[i] * math.log(pt[i] / ps[i]) for i in top), **TOL)
        assert v == pytest.approx(mass * (o + math.log(mass)), **TOL)
        assert o >= 0
    # k = V is the full forward KL; the form from returned log-probs and ids is the same function
    torch.testing.assert_close(topk_forward_kl(t, s, V), forward_kl(t, s), rtol=1e-12, atol=1e-14)
    lt = F.log_softmax(t / temperature, -1)
    top, ids = lt.topk(k, -1)
    torch.testing.assert_close(topk_forward_kl_from_logprobs(top, ids, s, temperature), ours, rtol=0, atol=0)
    with pytest.raises(ValueError, match="k must be at least 1"):
        topk_forward_kl(t, s, 0)


def test_sampled_estimators_values_sign_and_exact_expectation():
    t, s = logits_pair(4, shape=(5,))
    lt, ls = t.log_softmax(-1), s.log_softmax(-1)
    k1, k3 = reverse_kl_k1(ls, lt), reverse_kl_k3(ls, lt)
    for a, b, x, y in zip(k1.flatten().tolist(), k3.flatten().tolist(), ls.flatten().tolist(), lt.flatten().tolist()):
        r = math.exp(y - x)
        assert a == pytest.approx(x - y, **TOL)
        assert b == pytest.approx((r - 1) - math.log(r), **TOL)
        assert b >= 0
    # unbiased: the expectation over y ~ p_S, enumerated, is the reverse KL
    for k in (k1, k3):
        torch.testing.assert_close((ls.exp() * k).sum(-1), reverse_kl(t, s), rtol=1e-12, atol=1e-14)


def test_sampled_estimators_unbiased_by_monte_carlo():
    t, s = logits_pair(5, shape=(1,), scale=1.0)
    lt, ls = t.log_softmax(-1)[0], s.log_softmax(-1)[0]
    n = 200_000
    y = torch.multinomial(ls.exp(), n, replacement=True, generator=torch.Generator().manual_seed(0))
    truth = reverse_kl(t, s)[0].item()
    for est in (reverse_kl_k1, reverse_kl_k3):
        draws = est(ls[y], lt[y])
        mean, se = draws.mean().item(), draws.std().item() / math.sqrt(n)
        assert se < 0.02 * truth  # the check below is tight enough to see a bias of a few percent
        assert abs(mean - truth) < 4 * se


def test_sampled_estimators_expected_gradients():
    """E_y[grad k1] = 0 and E_y[grad k3] = grad KL(p_T || p_S): why k1 trains as an advantage and k3's
    gradient is the forward KL's (the expectation weights p_S held fixed, as sampling does)."""
    t, s = logits_pair(6, shape=(1,))
    for est, target in ((reverse_kl_k1, None), (reverse_kl_k3, forward_kl)):
        z = s.clone().requires_grad_(True)
        ls = z.log_softmax(-1)
        (ls.exp().detach() * est(ls, t.log_softmax(-1))).sum().backward()
        want = torch.zeros_like(s)
        if target is not None:
            z2 = s.clone().requires_grad_(True)
            target(t, z2).sum().backward()
            want = z2.grad
        torch.testing.assert_close(z.grad, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "topk_forward_kl"])
def test_gradients_finite_analytic_and_teacher_untouched(name):
    t, s = logits_pair(7)
    t[0, 0, 0] = -1e4  # a token the teacher all but rules out
    s[1, 2, 3] = -1e4  # one the student does
    t.requires_grad_(True)
    s.requires_grad_(True)
    divergence(name, t, s, temperature=0.9, beta=0.4, top_k=3).sum().backward()
    assert t.grad is None and torch.isfinite(s.grad).all()
    if name == "forward_kl":  # d/dz_S KL(p_T || p_S) = (p_S - p_T) / T
        want = ((s / 0.9).softmax(-1) - (t / 0.9).softmax(-1)) / 0.9
        torch.testing.assert_close(s.grad, want.detach(), rtol=1e-10, atol=1e-14)


def test_an_underflowed_probability_gives_no_nan():
    """fp32 softmax underflows to exactly 0 at logit gaps above ~104, and a model may mask tokens with -inf
    logits: 0 log 0 must count as 0, in value and gradient, on either side."""
    inf = float("inf")
    t = torch.tensor([[0.0, -200.0, 1.0, -inf]])
    s = torch.tensor([[0.5, 0.0, -300.0, -inf]], requires_grad=True)
    for name in ("forward_kl", "reverse_kl", "jsd"):
        s.grad = None
        value = divergence(name, t, s)
        value.sum().backward()
        assert torch.isfinite(value).all() and torch.isfinite(s.grad).all(), name


def test_identical_distributions_give_zero_and_unknown_name_refused():
    t, _ = logits_pair(8)
    for name in ("forward_kl", "reverse_kl"):
        assert divergence(name, t, t.clone()).abs().max().item() == 0.0
    assert generalized_jsd(t, t.clone(), 0.5).abs().max().item() < 1e-15
    with pytest.raises(ValueError, match="unknown distillation divergence 'tvd'"):
        divergence("tvd", t, t)
