"""The preference losses (exactrl/losses/preference.py) against each paper's formula written out here in
plain float64 arithmetic, value and gradient; against the peers' formulas (TRL, OpenRLHF, SimPO's
repository) copied by meaning, naming which of our options equals which; and KTO's reference point
from the whole step against the peers' per-micro-batch one."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from exactrl.losses.preference import PAIR_LOSSES, PairInput, PairParams, get_pair_loss, kto_losses, kto_reference_point

TOL = dict(rel=1e-12, abs=1e-12)


# ---- the papers' formulas, one pair at a time. M is `math` (values in floats) or `torch` (scalars with
# autograd for the gradient check): the same written formula gives both.

def sig(M, x):
    return 1 / (1 + M.exp(-x))


def logistic(M, x):  # -log sigma(x)
    return -M.log(sig(M, x))


def dpo_paper(M, c, r, lc, lr, rc, rr, beta, eps=0.0):
    """DPO (Rafailov et al. 2023, eq. 7); cDPO (Mitchell 2023): the label flipped with probability eps."""
    h = beta * ((c - rc) - (r - rr))
    return (1 - eps) * logistic(M, h) + eps * logistic(M, -h)


def robust_paper(M, c, r, lc, lr, rc, rr, beta, eps):
    """Robust DPO (Chowdhury et al. 2024): the unbiased estimator under flip rate eps."""
    h = beta * ((c - rc) - (r - rr))
    return ((1 - eps) * logistic(M, h) - eps * logistic(M, -h)) / (1 - 2 * eps)


def ipo_paper(M, c, r, lc, lr, rc, rr, tau, per_token):
    """IPO (Azar et al. 2023, eq. 17): (h - 1/(2 tau))^2, h on per-token or summed log-ratios."""
    h = (c - rc) / lc - (r - rr) / lr if per_token else (c - rc) - (r - rr)
    return (h - 1 / (2 * tau)) ** 2


def simpo_paper(M, c, r, lc, lr, rc, rr, beta, gamma, eps=0.0):
    """SimPO (Meng et al. 2024, eq. 6), gamma absolute; eps as TRL's and SimPO's code smooth it."""
    z = beta * c / lc - beta * r / lr - gamma
    return (1 - eps) * logistic(M, z) + eps * logistic(M, -z)


def orpo_paper(M, c, r, lc, lr, rc, rr, lam):
    """ORPO (Hong et al. 2024, eqs. 4-7): P = exp(mean token log-prob), odds = P / (1 - P)."""
    pc, pr = M.exp(c / lc), M.exp(r / lr)
    odds_c, odds_r = pc / (1 - pc), pr / (1 - pr)
    return -lam * M.log(sig(M, M.log(odds_c / odds_r)))


def bt_paper(M, c, r, margin, center):
    """Bradley-Terry reward-model loss with a margin (Llama 2 eq. 2) and reward centring (Eisenstein et al.)."""
    return logistic(M, c - r - margin) + center * (c + r) ** 2


def kto_paper(M, policy, ref, desirable, z, beta, wd, wu):
    """KTO (Ethayarajh et al. 2024): lambda_y - v(x, y), v = lambda_D sigma(beta (r - z)) for a desirable row,
    lambda_U sigma(beta (z - r)) for an undesirable one."""
    r = policy - ref
    return wd - wd * sig(M, beta * (r - z)) if desirable else wu - wu * sig(M, beta * (z - r))


# ---- inputs: pairs of different lengths; answers' mean token log-probs in [-1.5, -0.05] (ORPO needs P < 1)

def rows(n=9, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lc, lr = rng.randint(1, 40), rng.randint(1, 40)
        c, r = -lc * rng.uniform(0.05, 1.5), -lr * rng.uniform(0.05, 1.5)
        out.append((c, r, lc, lr, c + rng.uniform(-3, 3), r + rng.uniform(-3, 3)))
    return out


def args2(x):
    return x.chosen.detach(), x.rejected.detach()


def to_input(data, margin=None):
    cols = [torch.tensor(col, dtype=torch.float64) for col in zip(*data)]
    c, r = cols[0].clone().requires_grad_(), cols[1].clone().requires_grad_()
    return PairInput(c, r, cols[2], cols[3], cols[4], cols[5],
                     None if margin is None else torch.tensor(margin, dtype=torch.float64))


CASES = {  # name: (PairParams, the paper's formula for one pair)
    "dpo": (PairParams(beta=0.1), lambda M, *a: dpo_paper(M, *a, 0.1)),
    "cdpo": (PairParams(beta=0.3, label_smoothing=0.2), lambda M, *a: dpo_paper(M, *a, 0.3, 0.2)),
    "robust": (PairParams(beta=0.2, label_smoothing=0.1), lambda M, *a: robust_paper(M, *a, 0.2, 0.1)),
    "ipo": (PairParams(beta=0.1), lambda M, *a: ipo_paper(M, *a, 0.1, True)),
    "ipo_summed": (PairParams(beta=0.1, ipo_length_normalized=False), lambda M, *a: ipo_paper(M, *a, 0.1, False)),
    "simpo": (PairParams(beta=2.5, gamma=1.4), lambda M, *a: simpo_paper(M, *a, 2.5, 1.4)),
    "simpo_smoothed": (PairParams(beta=2.0, gamma=0.5, label_smoothing=0.1),
                       lambda M, *a: simpo_paper(M, *a, 2.0, 0.5, 0.1)),
    "orpo": (PairParams(orpo_lambda=0.25), lambda M, *a: orpo_paper(M, *a, 0.25)),
}


def loss_name(case):
    return case.removesuffix("_summed").removesuffix("_smoothed").replace("cdpo", "dpo")


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_loss_equals_its_papers_formula_value_and_gradient(case):
    params, formula = CASES[case]
    data = rows(seed=len(case))
    x = to_input(data)
    loss, metrics = get_pair_loss(loss_name(case)).fn(x, params)
    assert loss.shape == (len(data),) and metrics["chosen_reward"].shape == (len(data),)
    assert loss.tolist() == pytest.approx([formula(math, *row) for row in data], **TOL)
    # gradient of a weighted sum over pairs (the caller's normaliser is a weight) against autograd on the formula
    w = torch.rand(len(data), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((w * loss).sum(), [x.chosen, x.rejected])
    c, r = x.chosen.detach().clone().requires_grad_(), x.rejected.detach().clone().requires_grad_()
    want_loss = sum(w[i] * formula(torch, c[i], r[i], *row[2:]) for i, row in enumerate(data))
    want = torch.autograd.grad(want_loss, [c, r])
    for g, h in zip(got, want):
        assert g.tolist() == pytest.approx(h.tolist(), **TOL)


def test_bt_equals_its_formula_with_margin_and_centring_and_gradient():
    data = rows(seed=3)
    margin = [random.Random(i).uniform(0, 2) for i in range(len(data))]
    x = to_input(data, margin)
    loss, metrics = get_pair_loss("bt").fn(x, PairParams(center_rewards=0.01))
    want = [bt_paper(math, row[0], row[1], m, 0.01) for row, m in zip(data, margin)]
    assert loss.tolist() == pytest.approx(want, **TOL)
    assert metrics["chosen_reward"].tolist() == [row[0] for row in data]
    got = torch.autograd.grad(loss.sum(), [x.chosen, x.rejected])
    c, r = x.chosen.detach().clone().requires_grad_(), x.rejected.detach().clone().requires_grad_()
    want_grad = torch.autograd.grad(sum(bt_paper(torch, c[i], r[i], margin[i], 0.01) for i in range(len(data))), [c, r])
    for g, h in zip(got, want_grad):
        assert g.tolist() == pytest.approx(h.tolist(), **TOL)
    no_margin, _ = get_pair_loss("bt").fn(to_input(data), PairParams())
    assert no_margin.tolist() == pytest.approx([bt_paper(math, row[0], row[1], 0.0, 0.0) for row in data], **TOL)


def test_rewards_are_beta_log_ratios_for_the_dpo_family_and_beta_mean_logps_for_reference_free():
    data = rows(seed=5)
    x = to_input(data)
    for name in ("dpo", "robust", "ipo"):
        _, m = get_pair_loss(name).fn(x, PairParams(beta=0.3))
        assert m["chosen_reward"].tolist() == pytest.approx([0.3 * (row[0] - row[4]) for row in data], **TOL)
        assert m["rejected_reward"].tolist() == pytest.approx([0.3 * (row[1] - row[5]) for row in data], **TOL)
    _, m = get_pair_loss("simpo").fn(x, PairParams(beta=2.0))
    assert m["chosen_reward"].tolist() == pytest.approx([2.0 * row[0] / row[2] for row in data], **TOL)
    _, m = get_pair_loss("orpo").fn(x, PairParams(orpo_lambda=0.1))
    assert m["rejected_reward"].tolist() == pytest.approx([0.1 * row[1] / row[3] for row in data], **TOL)
    assert not any(v.requires_grad for v in m.values())


# ---- the peers' formulas, copied by meaning from their code (repository, file, lines at the commit read)

def trl_dpo(loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, beta, label_smoothing):
    """huggingface/trl f2cd5771 trl/trainer/dpo_trainer.py _compute_loss: log-ratios of summed log-probs
    (lines 1397-1398), 'sigmoid' 1434-1435, 'ipo' 1440-1451 (each answer's log-ratio divided by its
    completion-token count, clamped at 1), 'robust' 1475-1478; then .mean() over the micro-batch (1578)."""
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "ipo":
        ipo_delta = chosen_lr / chosen_len.clamp(min=1.0) - rejected_lr / rejected_len.clamp(min=1.0)
        return (ipo_delta - 1 / (2 * beta)) ** 2
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
    flipped = -label_smoothing * F.logsigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def openrlhf_dpo(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing, ipo):
    """OpenRLHF/OpenRLHF 3c3be623 openrlhf/models/loss.py DPOLoss.forward (lines 311-335), given the
    summed log-probs openrlhf/trainer/dpo_trainer.py passes (concatenated_forward, lines 322-324);
    then .mean() over the micro-batch (line 331)."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if ipo:
        return (logits - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def trl_simpo(avg_chosen, avg_rejected, beta, simpo_gamma, label_smoothing):
    """trl/experimental/cpo/cpo_trainer.py cpo_loss, loss_type='simpo' (lines 714-721) on average log-probs (849)."""
    logits = (avg_chosen - avg_rejected) - simpo_gamma / beta
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def simpo_repo(avg_chosen, avg_rejected, beta, gamma_beta_ratio):
    """princeton-nlp/SimPO scripts/simpo_trainer.py simpo_loss (sigmoid): logits = pi_logratios - gamma_beta_ratio."""
    return -F.logsigmoid(beta * ((avg_chosen - avg_rejected) - gamma_beta_ratio))


def trl_orpo(avg_chosen, avg_rejected, beta):
    """trl/experimental/orpo/orpo_trainer.py log1mexp (lines 88-92) and odds_ratio_loss (693-700) on average
    log-probs (808); the trainer's loss is nll - losses.mean() (851), so the per-pair term is -losses."""
    def log1mexp(x):
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
    log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
    return -(beta * F.logsigmoid(log_odds))


def trl_reward(rewards_chosen, rewards_rejected, margin, center_rewards_coefficient):
    """trl/trainer/reward_trainer.py compute_loss (lines 750-756), per pair before its .mean()."""
    loss = -F.logsigmoid(rewards_chosen - rewards_rejected - margin)
    return loss + center_rewards_coefficient * (rewards_chosen + rewards_rejected) ** 2


def test_the_dpo_family_matches_trl_and_openrlhf_and_says_which_ipo_option_is_whose():
    data = rows(seed=11)
    x = to_input(data)
    args = (x.chosen.detach(), x.rejected.detach(), x.ref_chosen, x.ref_rejected)
    ours = {name: get_pair_loss(name).fn(x, p)[0].detach() for name, p in [
        ("dpo", PairParams(beta=0.1)), ("robust", PairParams(beta=0.1, label_smoothing=0.1)),
        ("ipo", PairParams(beta=0.1, ipo_length_normalized=True))]}
    ipo_summed = get_pair_loss("ipo").fn(x, PairParams(beta=0.1, ipo_length_normalized=False))[0].detach()
    cdpo = get_pair_loss("dpo").fn(x, PairParams(beta=0.1, label_smoothing=0.2))[0].detach()
    trl = {name: trl_dpo(kind, *args, x.chosen_tokens, x.rejected_tokens, 0.1, 0.1)
           for name, kind in [("dpo", "sigmoid"), ("robust", "robust"), ("ipo", "ipo")]}
    for name in ours:
        assert ours[name].tolist() == pytest.approx(trl[name].tolist(), **TOL), name
    assert cdpo.tolist() == pytest.approx(openrlhf_dpo(*args, 0.1, 0.2, ipo=False).tolist(), **TOL)
    openrlhf_ipo = openrlhf_dpo(*args, 0.1, 0.0, ipo=True)
    assert ipo_summed.tolist() == pytest.approx(openrlhf_ipo.tolist(), **TOL)
    # the two IPO conventions are different losses when lengths differ: each peer matches one option only
    assert (ours["ipo"] - openrlhf_ipo).abs().max() > 1e-2
    assert (ipo_summed - trl["ipo"]).abs().max() > 1e-2


def test_simpo_orpo_and_bt_match_their_peers():
    data = rows(seed=13)
    x = to_input(data)
    avg_c, avg_r = x.chosen.detach() / x.chosen_tokens, x.rejected.detach() / x.rejected_tokens
    simpo = get_pair_loss("simpo").fn
    ours = simpo(x, PairParams(beta=2.0, gamma=0.5, label_smoothing=0.1))[0].detach()
    assert ours.tolist() == pytest.approx(trl_simpo(avg_c, avg_r, 2.0, 0.5, 0.1).tolist(), **TOL)
    # SimPO's repository sets gamma / beta: gamma_beta_ratio 0.25 at beta 2.5 is gamma = 0.625 here
    ours = simpo(x, PairParams(beta=2.5, gamma=0.625))[0].detach()
    assert ours.tolist() == pytest.approx(simpo_repo(avg_c, avg_r, 2.5, 0.25).tolist(), **TOL)
    ours, m = get_pair_loss("orpo").fn(x, PairParams(orpo_lambda=0.1))
    assert ours.tolist() == pytest.approx(trl_orpo(avg_c, avg_r, 0.1).tolist(), **TOL)
    odds = [math.exp(a) / (1 - math.exp(a)) for a in avg_c.tolist()], [
        math.exp(a) / (1 - math.exp(a)) for a in avg_r.tolist()]
    assert m["log_odds"].tolist() == pytest.approx([math.log(c / r) for c, r in zip(*odds)], **TOL)
    margin = torch.linspace(0, 1, len(data), dtype=torch.float64)
    ours = get_pair_loss("bt").fn(to_input(data, margin.tolist()), PairParams(center_rewards=0.01))[0].detach()
    assert ours.tolist() == pytest.approx(trl_reward(*args2(x), margin, 0.01).tolist(), **TOL)


# ---- KTO

def kto_rows(n, seed):
    rng = random.Random(seed)
    policy = [-rng.uniform(1, 30) for _ in range(n)]
    return (policy, [p + rng.uniform(-2, 2) for p in policy], [rng.random() < 0.6 for _ in range(n)],
            [-rng.uniform(5, 30) for _ in range(n)])


def test_kto_equals_its_papers_formula_value_and_gradient():
    policy, ref, desirable, kl_ref = kto_rows(11, seed=0)
    kl_policy = [k + d for k, d in zip(kl_ref, [random.Random(i).uniform(-0.5, 1.5) for i in range(11)])]
    z = kto_reference_point(torch.tensor(kl_policy, dtype=torch.float64), torch.tensor(kl_ref, dtype=torch.float64))
    z_paper = max(0.0, sum(p - r for p, r in zip(kl_policy, kl_ref)) / len(kl_ref))
    assert z.item() == pytest.approx(z_paper, **TOL) and z_paper > 0 and not z.requires_grad
    pol = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    loss = kto_losses(pol, torch.tensor(ref, dtype=torch.float64), torch.tensor(desirable), z, 0.3, 1.2, 0.8)
    want = [kto_paper(math, p, r, d, z_paper, 0.3, 1.2, 0.8) for p, r, d in zip(policy, ref, desirable)]
    assert loss.tolist() == pytest.approx(want, **TOL)
    (got,) = torch.autograd.grad(loss.sum(), pol)
    p2 = pol.detach().clone().requires_grad_()
    (want_grad,) = torch.autograd.grad(sum(kto_paper(torch, p2[i], ref[i], desirable[i], z_paper, 0.3, 1.2, 0.8)
                                           for i in range(11)), p2)
    assert got.tolist() == pytest.approx(want_grad.tolist(), **TOL)
    # z clamps at 0: a policy below the reference in KL terms does not lower the point
    assert kto_reference_point(torch.zeros(3), torch.ones(3)).item() == 0.0


def test_kto_matches_trl_given_the_same_z():
    """trl/trainer/kto_trainer.py lines 1553-1576: chosen 1 - sigmoid(beta (logratio - kl)), rejected
    1 - sigmoid(beta (kl - logratio)), each times its weight; kl = mean over the micro-batch's KL rows,
    gathered over ranks, clamped at 0."""
    policy, ref, desirable, kl_ref = kto_rows(8, seed=2)
    pol, rf, des = (torch.tensor(v, dtype=torch.float64) for v in (policy, ref, desirable))
    des = des.bool()
    kl_pol = torch.tensor(kl_ref, dtype=torch.float64) + 0.7
    kl = (kl_pol - torch.tensor(kl_ref, dtype=torch.float64)).mean().clamp(min=0)
    lr = pol - rf
    trl = torch.cat((1.0 * (1 - torch.sigmoid(0.1 * (lr[des] - kl))),
                     1.5 * (1 - torch.sigmoid(0.1 * (kl - lr[~des])))))
    z = kto_reference_point(kl_pol, torch.tensor(kl_ref, dtype=torch.float64))
    ours = kto_losses(pol, rf, des, z, 0.1, 1.0, 1.5)
    assert torch.cat((ours[des], ours[~des])).tolist() == pytest.approx(trl.tolist(), **TOL)


def kto_step_gradient(policy, ref, desirable, kl_policy, kl_ref, micro, z_from):
    """The gradient of one step's KTO objective (sum of row losses / rows in the step, exact everywhere)
    accumulated over micro-batches of `micro` rows, z from the whole step or from each micro-batch."""
    n = policy.numel()
    theta = torch.zeros((), dtype=torch.float64, requires_grad=True)  # shifts every policy log-prob
    grad = torch.zeros((), dtype=torch.float64)
    z_step = kto_reference_point(kl_policy, kl_ref)
    for s in range(0, n, micro):
        part = slice(s, s + micro)
        z = z_step if z_from == "step" else kto_reference_point(kl_policy[part], kl_ref[part])
        loss = kto_losses(policy[part] + theta, ref[part], desirable[part], z).sum() / n
        grad += torch.autograd.grad(loss, theta)[0]
    return grad.item()


def test_kto_update_is_independent_of_micro_batch_size_with_the_step_z_and_not_with_the_peers_z():
    g = torch.Generator().manual_seed(0)
    n = 12
    policy = -30 * torch.rand(n, generator=g, dtype=torch.float64)
    ref = policy + 2 * torch.randn(n, generator=g, dtype=torch.float64)
    desirable = torch.rand(n, generator=g) < 0.5
    kl_ref = -30 * torch.rand(n, generator=g, dtype=torch.float64)
    kl_policy = kl_ref + 3 * torch.randn(n, generator=g, dtype=torch.float64) + 1  # micro-batch KL means differ
    step = {m: kto_step_gradient(policy, ref, desirable, kl_policy, kl_ref, m, "step") for m in (1, 3, 4, 12)}
    peers = {m: kto_step_gradient(policy, ref, desirable, kl_policy, kl_ref, m, "micro") for m in (1, 3, 4, 12)}
    for m in step:
        assert step[m] == pytest.approx(step[12], rel=1e-12)
    assert peers[12] == pytest.approx(step[12], rel=1e-12)  # one micro-batch: the two are the same z
    for m in (1, 3, 4):
        assert abs(peers[m] - step[12]) > 1e-3 * abs(step[12]), (m, peers[m], step[12])


# ---- interface and refusals

def test_registry_declares_reference_use_and_knobs():
    assert sorted(PAIR_LOSSES) == ["bt", "dpo", "ipo", "orpo", "robust", "simpo"]
    assert {n for n, e in PAIR_LOSSES.items() if e.needs_reference} == {"dpo", "ipo", "robust"}
    fields = set(PairParams.__dataclass_fields__)
    for name, entry in PAIR_LOSSES.items():
        assert entry.paper and entry.peers and set(entry.uses) <= fields, name
        assert set(entry.paper_params) <= set(entry.uses), name
        entry.fn(to_input(rows(3)), PairParams(**entry.paper_params))
    with pytest.raises(ValueError, match="unknown pair loss 'sigmoid'"):
        get_pair_loss("sigmoid")


def test_bad_input_is_refused_with_a_clear_error():
    x = to_input(rows(3))
    no_ref = PairInput(x.chosen, x.rejected, x.chosen_tokens, x.rejected_tokens)
    with pytest.raises(ValueError, match="'dpo' needs the reference"):
        get_pair_loss("dpo").fn(no_ref, PairParams())
    with pytest.raises(ValueError, match="'ipo' takes no margin"):
        get_pair_loss("ipo").fn(PairInput(*args2(x), x.chosen_tokens, x.rejected_tokens, x.ref_chosen,
                                          x.ref_rejected, torch.zeros(3)), PairParams())
    empty = PairInput(*args2(x), torch.tensor([3.0, 0.0, 2.0]), x.rejected_tokens)
    with pytest.raises(ValueError, match="'simpo' length-normalises.*no loss tokens"):
        get_pair_loss("simpo").fn(empty, PairParams())
    with pytest.raises(ValueError, match="robust DPO needs label_smoothing"):
        get_pair_loss("robust").fn(x, PairParams(label_smoothing=0.5))
    with pytest.raises(ValueError, match="beta must be > 0"):
        PairParams(beta=0)
    with pytest.raises(ValueError, match="non-empty KL rows"):
        kto_reference_point(torch.zeros(0), torch.zeros(0))


# ---- the tests above can fail: a deliberate error in a loss is caught by the same comparison

def test_a_deliberate_error_is_caught():
    """IPO's target 1/(2 tau) written as 1/tau: the paper comparison above would fail by far more than TOL."""
    data = rows(seed=4)
    x = to_input(data)

    def broken_ipo(x, p):
        chosen, rejected = x.chosen - x.ref_chosen, x.rejected - x.ref_rejected
        h = chosen / x.chosen_tokens - rejected / x.rejected_tokens
        return (h - 1 / p.beta) ** 2

    want = [ipo_paper(math, *row, 0.1, True) for row in data]
    assert get_pair_loss("ipo").fn(x, PairParams())[0].tolist() == pytest.approx(want, **TOL)
    assert broken_ipo(x, PairParams()).tolist() != pytest.approx(want, **TOL)
