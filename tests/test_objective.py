"""The objective as declared data (exactrl/losses/objective.py), the step plan over every rank
(exactrl/distributed/step_plan.py) and the worker's accounting of what its losses saw."""

from __future__ import annotations

import pickle

import pytest
import torch

from exactrl.algorithms.registry import ALGORITHMS, Algorithm
from exactrl.algorithms.sft import demonstration
from exactrl.config import ConfigError, RLConfig, SFTConfig, load_config
from exactrl.config.methods import Method
from exactrl.data.batch import ORIGINS, Sample, collate
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import SampleAccountingError, build_engine
from exactrl.distributed.step_plan import plan_samples, plan_step
from exactrl.losses.objective import Cosine, Linear, Metrics, NLLTerm, Objective, PolicyTerm
from exactrl.workers.worker import Worker

COMPLETIONS = ["1", "2+2+0=04 #### 04", "#### 77", "9+9+0=18 1+1+1=03 #### 318", "x", "12345678901234567890", "ab",
               "#### 1"]


def test_an_objective_is_plain_picklable_data_declared_by_the_registry():
    cfg = load_config(RLConfig, None, ["algo.kl_coef=0.1", "algo.entropy_coef=0.01", "algo.dual_clip=3"])
    objective = ALGORITHMS.lookup("grpo").objective(cfg)
    assert pickle.loads(pickle.dumps(objective)) == objective  # a Ray actor can receive it
    assert [t.kind for t in objective.terms] == ["policy", "kl", "entropy"]
    assert (objective.terms[0].dual_clip, objective.terms[1].coef, objective.terms[2].coef) == (3.0, 0.1, 0.01)
    assert objective.fields() == ("logprobs", "entropy")
    in_reward = ALGORITHMS.lookup("grpo").objective(load_config(RLConfig, None, [
        "algo.kl_coef=0.1", "algo.kl_in_reward=true"]))
    assert [t.kind for t in in_reward.terms] == ["policy"] and in_reward.metrics == ()  # no entropy pass unless asked
    logged = ALGORITHMS.lookup("grpo").objective(load_config(RLConfig, None, ["algo.log_entropy=true"]))
    assert logged.metrics == ("entropy",) and logged.fields() == ("logprobs", "entropy")
    assert objective.with_term("kl", coef=0.2).terms[1].coef == 0.2  # the adaptive KL's per-rollout value


def test_a_kl_in_the_reward_must_land_somewhere():
    """An estimator that does not declare how it reads per-token rewards is refused with
    algo.kl_in_reward=true (the bug this prevents: grpo & co. ignored them, training with no KL)."""
    cfg = load_config(RLConfig, None, ["algo.kl_coef=0.1", "algo.kl_in_reward=true"])
    with pytest.raises(ConfigError,
                       match="estimator 'mine' does not read per-token rewards, so the KL would land nowhere"):
        Algorithm(Method("x", "", "", "mine")).objective(cfg)


def test_a_scheduled_coefficient_is_resolved_per_step():
    objective = Objective((NLLTerm(coef=Linear(1.0, 0.0, 10)),))
    assert [objective.at(s).terms[0].coef for s in (0, 5, 10, 20)] == [1.0, 0.5, 0.0, 0.0]


def test_a_cosine_schedule_warms_up_then_follows_a_half_cosine_to_its_valley():
    """CHORD's mu: linear 0 -> peak over the warm-up, then peak -> valley along a half cosine."""
    mu = Cosine(warmup=4, peak=0.9, valley=0.1, steps=12)
    cosine = torch.cos(torch.pi * torch.arange(8, dtype=torch.float64) / 8)
    expect = [0.9 * s / 4 for s in range(4)] + (0.1 + 0.4 * (1 + cosine)).tolist() + [0.1, 0.1]
    assert [mu.at(s) for s in range(14)] == pytest.approx(expect, abs=1e-12)
    assert (mu.at(4), mu.at(8), mu.at(12)) == pytest.approx((0.9, 0.5, 0.1))
    complement = Objective((NLLTerm(coef=Cosine(4, 0.1, 0.9, 12, start=1.0)),))
    assert [complement.at(s).terms[0].coef for s in range(14)] == pytest.approx([1 - x for x in expect], abs=1e-12)
    with pytest.raises(ValueError, match="warms up within its steps"):
        Cosine(warmup=5, peak=1, valley=0, steps=4)


def test_the_plan_covers_every_rank_and_never_splits_a_unit():
    lengths = [9, 1, 2, 8, 3, 7, 4, 6]
    plan = plan_step([1] * 8, 2, "token-mean", lengths=lengths, world_size=2, unit=2,
                     sources=["chosen", "rejected"] * 4)
    assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(8))
    # a pair stays together, sorted as one
    assert all({mb[0] // 2} == {i // 2 for i in mb} for mb in plan.micro_batches)
    assert (plan.for_rank(0).micro_batches + plan.for_rank(1).micro_batches
            == plan.micro_batches[0::2] + plan.micro_batches[1::2])
    assert [(c.source, c.seqs, c.units) for c in plan.counts] == [("chosen", 4, 4), ("rejected", 4, 0)]
    with pytest.raises(ValueError, match="units of 2 samples do not fit"):
        plan_step([1] * 6, 3, "token-mean", unit=2)


def examples(tokenizer):
    return encode_sft([Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)],
                      tokenizer, 256)


def sgd_worker(model, tokenizer):
    cfg = load_config(SFTConfig, None, ["optim.name=sgd", "optim.lr=1.0", "optim.scheduler=constant",
                                        "train.max_grad_norm=0"])
    return Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_two_terms_with_their_own_normalisers_give_the_exact_mixed_gradient(tokenizer, make_model, micro):
    """Demonstrations under a token-mean NLL, on-policy rows under 0.5 x a seq-mean-token-mean NLL,
    each term normalised over its own samples of the whole step: the applied update is the one-pass
    gradient of that loss, and the canary (shares summed over terms) is exactly 1."""
    samples = [demonstration(e) for e in examples(tokenizer)]
    for s in samples[1::2]:
        s.source = "on_policy"
    objective = Objective((NLLTerm(sources=("demonstration",)), NLLTerm(coef=0.5, sources=("on_policy",),
                                                                        agg="seq-mean-token-mean")))
    ref = make_model(3)
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [tokenizer.pad_token_id] * (width - len(s.ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    mask = torch.tensor([list(s.loss_mask) + [0] * (width - 1 - len(s.loss_mask)) for s in samples]).float()
    nll = -torch.log_softmax(ref(input_ids=ids, attention_mask=attn).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[
        ..., 0]
    demo, pol = mask[0::2], mask[1::2]
    loss = (nll[0::2] * demo).sum() / demo.sum() + 0.5 * ((nll[1::2] * pol).sum(1) / pol.sum(1)).mean()
    loss.backward()
    model = make_model(3)
    p0 = [p.detach().clone() for p in model.parameters()]
    result = sgd_worker(model, tokenizer).train_step(samples, plan_samples(samples, micro, "token-mean", sort=True),
                                                     objective)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6) and result.loss == pytest.approx(
        loss.item(), rel=1e-6)
    for p, q, before in zip(model.parameters(), ref.parameters(), p0):
        assert torch.allclose(before - p.detach(), q.grad, rtol=1e-5, atol=1e-7)


def assert_applies_the_reference(make_model, tokenizer, samples, plan, objective, ref, loss) -> None:
    """One SGD step (lr 1) of the worker under ``plan`` applies exactly ``ref``'s gradient of ``loss``
    (already backpropagated), reports that loss, and its canary reads 1."""
    model = make_model(3)
    p0 = [p.detach().clone() for p in model.parameters()]
    result = sgd_worker(model, tokenizer).train_step(samples, plan, objective)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    for p, q, before in zip(model.parameters(), ref.parameters(), p0):
        assert torch.allclose(before - p.detach(), q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro", [1, 3, 8])
def test_token_weighted_terms_give_the_exact_weighted_gradient(tokenizer, make_model, micro):
    """SRFT's sg(e^{-H}) and CHORD's phi = p(1 - p) weights, each on its own samples: the applied
    update is the one-pass gradient of sum(w * nll) / tokens with w held constant (stop-gradient),
    over micro-batches of uneven size (8 samples in micro-batches of at most 3 are 3, 3, 2)."""
    samples = [demonstration(e) for e in examples(tokenizer)]
    for s in samples[1::2]:
        s.source = "on_policy"
    objective = Objective((NLLTerm(weight="exp_neg_entropy", sources=("demonstration",)),
                           NLLTerm(coef=0.5, weight="p_one_minus_p", sources=("on_policy",))))
    assert objective.fields() == ("logprobs", "entropy")
    ref = make_model(3)
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [tokenizer.pad_token_id] * (width - len(s.ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    mask = torch.tensor([list(s.loss_mask) + [0] * (width - 1 - len(s.loss_mask)) for s in samples]).float()
    logp_all = torch.log_softmax(ref(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    w_demo = torch.exp(-entropy).detach()
    w_pol = (logp.exp() * (1 - logp.exp())).detach()
    demo, pol = mask[0::2], mask[1::2]
    loss = (-logp * w_demo)[0::2].mul(demo).sum() / demo.sum() + 0.5 * (-logp * w_pol)[1::2].mul(pol).sum() / pol.sum()
    loss.backward()
    assert_applies_the_reference(make_model, tokenizer, samples, plan_samples(samples, micro, "token-mean", sort=True),
                                 objective, ref, loss)
    with pytest.raises(ValueError, match="weight is one of exp_neg_entropy, p_one_minus_p"):
        NLLTerm(weight="entropy")


def test_the_accounting_counts_what_the_losses_saw(tokenizer, make_model, monkeypatch):
    """Before, the engine compared the plan with counts taken from the same plan, so it could not
    fail; now the worker counts the rows and loss tokens of the tensors that entered each loss."""
    import exactrl.workers.worker as worker_module

    samples = [demonstration(e) for e in examples(tokenizer)]
    real = worker_module.collate

    def loses_a_row(chunk, pad_id, device=None):  # a collate that drops the last row's loss tokens
        b = real(chunk, pad_id, device)
        b["loss_mask"][-1] = 0
        return b

    monkeypatch.setattr(worker_module, "collate", loses_a_row)
    objective = Objective((NLLTerm(),))
    with pytest.raises(SampleAccountingError,
                       match=r"the plan has 8 samples / \d+ loss tokens, the policy's losses saw 8 / \d+"):
        sgd_worker(make_model(0), tokenizer).train_step(samples, plan_samples(samples, 4, "token-mean"), objective)


def test_a_micro_batch_missing_old_logprobs_is_refused_not_read_as_its_own(tokenizer, make_model):
    cfg = load_config(RLConfig, None, ["algo.group_size=2"])
    samples = [Sample([1, 5, 6], [7, 8], advantages=torch.ones(4)) for _ in range(2)]
    objective = ALGORITHMS.lookup("grpo").objective(cfg)
    with pytest.raises(ValueError, match="reads old_logprobs, which this micro-batch's samples do not carry"):
        sgd_worker(make_model(0), tokenizer).train_step(samples, plan_samples(samples, 2, "token-mean"), objective)



def prefix_guided(tokenizer) -> tuple[list[Sample], list[list[str]]]:
    """Rows as a prefix-guided step (LUFFY, issue 23) has them: demonstrations (0, 4), a policy
    response (1), and policy responses continuing a demonstration's prefix, whose first half of
    the loss tokens the demonstration wrote (one, row 2, all prefix: no policy token). Returns the
    samples and each target's origin, written out independently of Sample's own derivation."""
    samples, written = [], []
    for i, e in enumerate(examples(tokenizer)):
        s = demonstration(e)
        s.advantages = torch.full((s.num_targets,), (-1.0) ** i * (1 + i) / 4)
        s.gen_logprobs = torch.zeros(s.num_targets)
        loss_at = [t for t, m in enumerate(s.loss_mask) if m]
        cut = {0: len(loss_at), 4: len(loss_at), 1: 0, 2: len(loss_at)}.get(i, (len(loss_at) + 1) // 2)
        tokens = ["policy"] * s.num_targets
        for t in loss_at[:cut]:
            tokens[t] = "demonstration"
        if i not in (0, 4):
            s.source, s.origin = "on_policy", None if i == 1 else tuple(tokens)
        samples.append(s)
        written.append(tokens)
    return samples, written


# LUFFY-style: the policy-gradient term on the policy's own tokens, one mean per sequence that has
# any; an NLL term on the demonstrations' tokens (whole or prefix), one mean over all of them.
PREFIX_GUIDED = Objective((PolicyTerm(old="self", origins=("policy",), agg="seq-mean-token-mean"),
                           NLLTerm(coef=0.5, origins=("demonstration",))))


def prefix_guided_reference(model, samples, written, pad_id):
    """The step loss of PREFIX_GUIDED in one pass over the padded batch, from plain masks."""
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [pad_id] * (width - len(s.ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    pad = [0] * (width - 1)
    mask = torch.tensor([(list(s.loss_mask) + pad)[: width - 1] for s in samples]).float()
    demo = mask * torch.tensor([([o == "demonstration" for o in w] + pad)[: width - 1] for w in written])
    pol = mask - demo
    adv = torch.stack([torch.nn.functional.pad(s.advantages, (0, width - 1 - s.num_targets)) for s in samples])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    surrogate = -adv * torch.exp(logp - logp.detach())  # the ratio is 1 in value, grad log p in gradient
    has = pol.sum(1) > 0  # row 2 (all prefix) is no sequence of the policy term
    policy = ((surrogate * pol).sum(1)[has] / pol.sum(1)[has]).mean()
    return policy + 0.5 * (-logp * demo).sum() / demo.sum()


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_terms_scoped_by_token_origin_give_the_exact_prefix_guided_gradient(tokenizer, make_model, micro):
    """Sequences part demonstration prefix, part policy continuation: each term applies to its
    origin's tokens only, normalised over exactly those tokens (and the sequences having one) of
    the whole step; the update is the one-pass gradient and the canary is exactly 1."""
    samples, written = prefix_guided(tokenizer)
    ref = make_model(3)
    loss = prefix_guided_reference(ref, samples, written, tokenizer.pad_token_id)
    loss.backward()
    assert_applies_the_reference(make_model, tokenizer, samples, plan_samples(samples, micro, "token-mean", sort=True),
                                 PREFIX_GUIDED, ref, loss)


def test_origin_scoped_normalisers_hold_across_ranks(tokenizer, make_model):
    """World size 2 as the global plan lays it out: each rank's micro-batches, run through the
    worker's own micro-batch path under the plan's step-wide normalisers, add up over both ranks
    to the one-pass loss and gradient, and their canary shares to exactly 1."""
    samples, written = prefix_guided(tokenizer)
    ref = make_model(3)
    loss = prefix_guided_reference(ref, samples, written, tokenizer.pad_token_id)
    loss.backward()
    model = make_model(3)
    worker = sgd_worker(model, tokenizer)
    plan = plan_samples(samples, 2, "token-mean", world_size=2, sort=True)
    normalizers, total, shares = PREFIX_GUIDED.normalizers(plan), 0.0, 0.0
    for rank in (0, 1):
        for mb in plan.for_rank(rank).micro_batches:
            part, share, _ = worker.micro_batch([samples[i] for i in mb], PREFIX_GUIDED, normalizers, Metrics())
            part.backward()
            total, shares = total + part.item(), shares + share
    assert shares == pytest.approx(1.0, abs=1e-12) and total == pytest.approx(loss.item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_the_plan_counts_tokens_and_sequences_per_source_and_origin():
    demo = Sample([], [1, 2, 3, 4], source="demonstration", mask=(1, 1, 1))  # 3 loss tokens, demonstration
    mixed = Sample([1, 2], [3, 4, 5], origin=("policy", "demonstration", "demonstration", "policy"))  # 2 demo, 1 policy
    prefix = Sample([1, 2], [3, 4], origin=("policy", "demonstration", "demonstration"))  # all prefix
    own = Sample([1, 2], [3, 4])  # 2 policy
    plan = plan_samples([demo, mixed, prefix, own], 2, "token-mean")
    assert plan.count() == (10, 4) and plan.count(origins=("policy",)) == (3, 2)
    assert plan.count(origins=("demonstration",)) == (7, 3) and plan.count(["on_policy"], ["demonstration"]) == (4, 2)
    assert plan.count(origins=ORIGINS) == (10, 4)  # a sequence with tokens of both origins counts once
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert collate([mixed, prefix], 0)["origin"].tolist() == [[0, 1, 1, 0], [0, 1, 1, 0]]
    with pytest.raises(ValueError, match=r"origin names one of policy, demonstration, environment, template per "
                                         r"target \(4 of them\); got 3"):
        plan_samples([Sample([1, 2], [3, 4, 5], origin=("policy",) * 3)], 1, "token-mean")
    with pytest.raises(ValueError, match="a nll term's origins are some of policy, demonstration, environment, "
                                         "template"):
        NLLTerm(origins=("teacher",))


def test_a_step_no_term_applies_to_is_refused(tokenizer, make_model):
    """Before: a step holding no token of any term's sources or origins divided by zero
    (ZeroDivisionError) inside the worker; now it is refused, saying what the step has."""
    samples = [Sample([1, 5, 6], [7, 8]) for _ in range(2)]
    plan, worker = plan_samples(samples, 2, "token-mean"), sgd_worker(make_model(0), tokenizer)
    for term in (NLLTerm(origins=("demonstration",)), NLLTerm(sources=("demonstration",))):
        with pytest.raises(ValueError, match=r"no term of the objective applies to a loss token of this step .*"
                                             r"by source/origin: on_policy/policy: 4\)"):
            worker.train_step(samples, plan, Objective((term,)))
