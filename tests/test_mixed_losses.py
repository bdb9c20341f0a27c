"""LUFFY's and SRFT's losses against their papers' formulas, written out here in plain torch on
hand-made tensors (value AND gradient):

LUFFY (arXiv 2504.14945, its objective): J = 1/Z [sum_demo sum_t f(p_t) A + sum_on sum_t min(r_t A, clip(r_t) A)],
f(p) = p / (p + gamma), behaviour probability 1 on demonstrations, Z = every token of the group.
SRFT (arXiv 2506.19767): w_SFT = 0.5 sg(e^{-H}) on the demonstrations' NLL; the demonstrations'
RL term -min(p A, clip(p) A); on the policy's responses w_RL = 0.1 sg(e^{H}) times the NLL of a positive
response, +log p of a negative one.
"""

from __future__ import annotations

import pytest
import torch

from exactrl.data.batch import Sample, collate
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Metrics, MixedPolicyTerm, Objective, OutcomeTerm, micro_batch_loss
from exactrl.losses.policy import demonstration_loss

D = torch.float64  # exact comparisons (the default dtype is left alone: it is the whole session's)


def test_luffy_shaping_value_and_gradient_by_hand():
    logp = torch.log(torch.tensor([0.01, 0.1, 0.5, 0.9], dtype=D)).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=D)
    loss = demonstration_loss(logp, adv, gamma=0.1)
    p = torch.tensor([0.01, 0.1, 0.5, 0.9], dtype=D)
    assert torch.allclose(loss, -adv * p / (p + 0.1), rtol=1e-12)
    loss.sum().backward()
    # d/dlog p of -A p/(p+g) = -A g p / (p+g)^2: large relative to p on rare tokens, unlike -A p
    assert torch.allclose(logp.grad, -adv * 0.1 * p / (p + 0.1) ** 2, rtol=1e-12)


def test_srft_demonstration_ratio_is_p_and_clipped_by_hand():
    p = torch.tensor([0.3, 0.95, 0.95, 0.3], dtype=D)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=D)
    logp = p.log().requires_grad_()
    loss = demonstration_loss(logp, adv, clip=(0.2, 0.2))
    # min(pA, clip(p, 0.8, 1.2) A) with p <= 1: only the lower bound can act, on a negative advantage
    # whose token is already below 0.8 (no gradient there)
    expected = -torch.tensor([0.3, 0.95, -0.95, -0.8], dtype=D)
    assert torch.allclose(loss, expected, rtol=1e-12)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([-0.3, -0.95, 0.95, 0.0], dtype=D), rtol=1e-12)
    assert torch.allclose(demonstration_loss(p.log(), adv), -p * adv, rtol=1e-12)  # unclipped: -p A


def mixed_batch():
    """A GRPO group of 3 on-policy responses of different lengths and 1 demonstration (the longest),
    with rewards, advantages and old log-probs off by a little so the ratios and the clip act."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (n, src, reward) in enumerate([(2, "on_policy", 1.0), (5, "on_policy", 0.0), (3, "on_policy", 0.0),
                                          (7, "demonstration", 1.0)]):
        s = Sample([1, 2, 3], list(range(4, 4 + n)), reward=reward, source=src)
        t = s.num_targets
        s.advantages = torch.zeros(t, dtype=D)
        s.advantages[2:] = [1.2, -0.6, -0.6, 1.5][i]
        s.old_logprobs = -torch.rand(t, generator=g, dtype=D) * 2
        samples.append(s)
    b = collate(samples, 0)
    logits = torch.randn(*b["loss_mask"].shape, generator=g, dtype=D)
    logp = (b["old_logprobs"] + 0.4 * logits).clamp(max=-1e-3).detach().requires_grad_()
    entropy = torch.rand(*b["loss_mask"].shape, generator=g, dtype=D) * 3
    return samples, b, logp, entropy


def run(objective, samples, b, fields, micro):
    """The step loss as the worker adds it up: each micro-batch's share under the step's normalisers."""
    plan = plan_samples(samples, micro, "token-mean")
    normalizers, m, total = objective.normalizers(plan), Metrics(), 0.0
    for mb in plan.micro_batches:
        rows = list(mb)
        part = {k: v[rows] for k, v in b.items()}
        f = {k: v[rows] for k, v in fields.items()}
        loss, _ = micro_batch_loss(objective, f, part, part, [samples[i].source for i in rows], normalizers, m)
        total = total + loss
    return total, m


def luffy_by_the_paper(samples, b, logp, clip=(0.2, 0.2), gamma=0.1):
    total, tokens = 0.0, 0
    for i, s in enumerate(samples):
        mask = b["loss_mask"][i].bool()
        lp, adv = logp[i][mask], b["advantages"][i][mask]
        if s.source == "demonstration":
            p = lp.exp()
            total = total + (p / (p + gamma) * adv).sum()
        else:
            r = torch.exp(lp - b["old_logprobs"][i][mask])
            total = total + torch.minimum(r * adv, r.clamp(1 - clip[0], 1 + clip[1]) * adv).sum()
        tokens += int(mask.sum())
    return -total / tokens


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_luffy_term_is_the_papers_one_normaliser_loss(micro):
    samples, b, logp, _ = mixed_batch()
    objective = Objective((MixedPolicyTerm(gamma=0.1),))
    loss, m = run(objective, samples, b, {"logprobs": logp}, micro)
    (grad,) = torch.autograd.grad(loss, logp)
    ref = luffy_by_the_paper(samples, b, logp)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(loss, ref, rtol=1e-12) and torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-15)
    assert grad[3].abs().sum() > 0 and m.sums["clip_frac"] > 0  # the demonstration learns, the clip acts
    # the ratio metric covers the policy's tokens only: a demonstration's ratio is not 1 by construction
    on = b["loss_mask"][:3].bool()
    assert torch.isclose(m.maxima["ratio_dev"], (torch.exp(logp[:3] - b["old_logprobs"][:3]) - 1).abs()[on].max())


def test_luffy_unclipped_on_policy_tokens_use_the_plain_ratio():
    samples, b, logp, _ = mixed_batch()
    loss, _ = run(Objective((MixedPolicyTerm(loss="reinforce", gamma=0.1),)), samples, b, {"logprobs": logp}, 2)
    ref = luffy_by_the_paper(samples, b, logp, clip=(1e9, 1e9))
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert torch.allclose(*(torch.autograd.grad(x, logp)[0] for x in (loss, ref)), rtol=1e-10)


def test_two_terms_with_their_own_normalisers_would_be_a_mean_of_means():
    """What the one normaliser prevents: the demonstration's term averaged by itself."""
    samples, b, logp, _ = mixed_batch()
    split = Objective((MixedPolicyTerm(sources=("on_policy",)), MixedPolicyTerm(sources=("demonstration",))))
    loss, _ = run(split, samples, b, {"logprobs": logp}, 2)
    assert not torch.allclose(loss, luffy_by_the_paper(samples, b, logp), rtol=1e-3)


def test_outcome_terms_by_hand():
    samples, b, logp, _ = mixed_batch()
    on = ("on_policy",)
    objective = Objective((OutcomeTerm(sign="positive", coef=0.1, sources=on),
                           OutcomeTerm(sign="negative", sources=on)))
    loss, m = run(objective, samples, b, {"logprobs": logp}, 1)
    mask = b["loss_mask"].bool()
    tokens = int(mask[:3].sum())
    ref = (0.1 * -logp[0][mask[0]].sum() + logp[1][mask[1]].sum() + logp[2][mask[2]].sum()) / tokens
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert torch.allclose(*(torch.autograd.grad(x, logp)[0] for x in (loss, ref)), rtol=1e-12)
    share = m.sums["positive_fraction"] / m.counts["positive_fraction"]
    assert float(share) == pytest.approx(int(mask[0].sum()) / tokens)


def srft_by_the_paper(samples, b, logp, entropy, clip=(0.2, 0.2), sign=-1.0, gamma=None):
    """SRFT on the batch: the demonstrations' terms over their tokens, the policy's over theirs.
    sign=+1, gamma=0.1, clip=None: its official code's w_SFT = 0.5 sg(e^{+H}) and LUFFY's shaped,
    unclipped demonstration term."""
    demo, on, n_demo, n_on = 0.0, 0.0, 0, 0
    for i, s in enumerate(samples):
        mask = b["loss_mask"][i].bool()
        lp, h, adv = logp[i][mask], entropy[i][mask], b["advantages"][i][mask]
        if s.source == "demonstration":
            p = lp.exp() if gamma is None else lp.exp() / (lp.exp() + gamma)
            rl = p * adv if clip is None else torch.minimum(p * adv, p.clamp(1 - clip[0], 1 + clip[1]) * adv)
            demo = demo + (0.5 * torch.exp(sign * h) * -lp).sum() - rl.sum()
            n_demo += int(mask.sum())
        else:
            on = on + ((0.1 * torch.exp(h) * -lp).sum() if s.reward >= 1.0 else lp.sum())
            n_on += int(mask.sum())
    return demo / n_demo + on / n_on


@pytest.mark.parametrize("micro", [1, 3])
def test_srft_objective_from_the_registry_is_the_papers_loss(micro):
    from exactrl.algorithms.registry import ALGORITHMS
    from exactrl.config import RLConfig, load_config

    samples, b, logp, entropy = mixed_batch()
    b["advantages"][3, 2:] = torch.tensor([1.5, -0.5, 1.5, -0.5, 1.5, -0.5, 1.5], dtype=D)  # both clip sides
    logp.data[3, 2:] = torch.tensor([0.9, 0.5, 0.1, 0.95, 0.7, 0.02, 0.85], dtype=D).log()
    objective = ALGORITHMS.lookup("srft").objective(load_config(RLConfig, None, ["algo.name=srft"]))
    assert objective.fields() == ("logprobs", "entropy")
    loss, _ = run(objective, samples, b, {"logprobs": logp, "entropy": entropy}, micro)
    ref = srft_by_the_paper(samples, b, logp, entropy)
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert torch.allclose(*(torch.autograd.grad(x, logp)[0] for x in (loss, ref)), rtol=1e-10, atol=1e-15)
    unclipped = ALGORITHMS.lookup("srft").objective(load_config(RLConfig, None, ["algo.name=srft",
                                                                                 "algo.srft.demo_clip=false"]))
    loss, _ = run(unclipped, samples, b, {"logprobs": logp, "entropy": entropy}, micro)
    assert torch.allclose(loss, srft_by_the_paper(samples, b, logp, entropy, clip=None), rtol=1e-12)


@pytest.mark.parametrize("micro", [1, 3])
def test_srft_objective_as_its_official_code_computes_it(micro):
    """algo.srft.sft_weight=exp_entropy demo_gamma=0.1 demo_clip=false: the code's sg(e^{+H}) on the
    demonstrations' NLL and LUFFY's shaped, unclipped term on their ratio; value and gradient."""
    from exactrl.algorithms.registry import ALGORITHMS
    from exactrl.config import RLConfig, load_config

    samples, b, logp, entropy = mixed_batch()
    logp.data[3, 2:] = torch.tensor([0.9, 0.5, 0.1, 0.95, 0.7, 0.02, 0.85], dtype=D).log()
    code = ["algo.name=srft", "algo.srft.sft_weight=exp_entropy", "algo.srft.demo_gamma=0.1",
            "algo.srft.demo_clip=false"]
    objective = ALGORITHMS.lookup("srft").objective(load_config(RLConfig, None, code))
    loss, _ = run(objective, samples, b, {"logprobs": logp, "entropy": entropy}, micro)
    ref = srft_by_the_paper(samples, b, logp, entropy, clip=None, sign=1.0, gamma=0.1)
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert torch.allclose(*(torch.autograd.grad(x, logp)[0] for x in (loss, ref)), rtol=1e-10, atol=1e-15)
    # each choice moves the value: neither option is silently ignored
    for wrong in (dict(sign=-1.0, gamma=0.1), dict(sign=1.0, gamma=None)):
        assert not torch.allclose(loss, srft_by_the_paper(samples, b, logp, entropy, clip=None, **wrong), rtol=1e-6)


def test_luffy_objective_from_the_registry_follows_paper_or_code():
    from exactrl.algorithms.registry import ALGORITHMS
    from exactrl.config import RLConfig, load_config

    samples, b, logp, _ = mixed_batch()
    paper = ALGORITHMS.lookup("luffy").objective(load_config(RLConfig, None, ["algo.name=luffy"]))
    (term,) = paper.terms
    assert isinstance(term, MixedPolicyTerm) and (term.loss, term.gamma, term.agg) == ("ppo", 0.1, "token-mean")
    loss, _ = run(paper, samples, b, {"logprobs": logp}, 2)
    assert torch.allclose(loss, luffy_by_the_paper(samples, b, logp), rtol=1e-12)
    # its code: no clip, and the loss sum over a constant length (the padded response length) per sequence
    code = ALGORITHMS.lookup("luffy").objective(load_config(RLConfig, None, [
        "algo.name=luffy", "algo.luffy.clip=false", "train.loss_agg=seq-mean-token-sum-norm",
        "train.loss_agg_norm=16"]))
    plan = plan_samples(samples, 2, "seq-mean-token-sum-norm", 16)
    normalizers, m, total = code.normalizers(plan), Metrics(), 0.0
    for mb in plan.micro_batches:
        rows = list(mb)
        part = {k: v[rows] for k, v in b.items()}
        total = total + micro_batch_loss(code, {"logprobs": logp[rows]}, part, part,
                                         [samples[i].source for i in rows], normalizers, m)[0]
    ref = luffy_by_the_paper(samples, b, logp, clip=(1e9, 1e9)) * sum(s.loss_tokens for s in samples) / (4 * 16)
    assert torch.allclose(total, ref, rtol=1e-12)
