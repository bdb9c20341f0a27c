"""LUFFY's and SRFT's step gradient is the full-batch gradient whatever the split into
micro-batches, on mixed batches whose micro-batches hold very different shares of demonstration
and on-policy tokens (where a mean of means bites).

Reference: ONE padded forward over the whole step, the losses written out here from the papers'
formulas in plain torch (tests/test_mixed_losses.py checks the same formulas on hand-made
tensors). exactrl path: plan_samples, Worker.micro_batch under the algorithm's own objective,
engine.backward per micro-batch, as train_rl does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config import RLConfig, load_config
from exactrl.data.batch import Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Metrics
from exactrl.tasks.arithmetic import Problem, worked_solution
from exactrl.workers.worker import Worker

TOL = 1e-5  # fp32: relative error of the whole gradient
NORM_LEN = 40
# two GRPO groups of 3 sampled responses and 1 demonstration; (prompt, response, source, reward, advantage)
GROUPS = [
    ("12+3=", ["#### 15", "1", "15 #### 16"], worked_solution(Problem(12, 3)), [1.0, 0.0, 0.0], [1.2, -0.5, -0.5, 1.4]),
    ("347+285=", ["#### 632", "6", "#### 630"], worked_solution(Problem(347, 285)), [1.0, 0.0, 1.0],
     [0.6, -1.1, 0.6, 0.6]),
]


@pytest.fixture(scope="module")
def batch(tokenizer, make_model):
    samples = []
    for prompt, responses, demo, rewards, advs in GROUPS:
        p = tokenizer(prompt)["input_ids"]
        for text, src, reward, adv in zip([*responses, demo], ["on_policy"] * 3 + ["demonstration"], [*rewards, 1.0],
                                          advs):
            r = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            s = Sample(p, r, reward=reward, source=src)
            s.advantages = torch.tensor([0.0] * (len(p) - 1) + [adv] * len(r))
            samples.append(s)
    with torch.no_grad():
        logp, _ = forward(make_model(0), samples, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(3)
    for s, row in zip(samples, logp):
        s.old_logprobs = (row + 0.3 * torch.randn(row.shape, generator=g))[: s.num_targets].clone()
    return samples


def forward(model, samples, pad_id):
    """log p of each target and the entropy of its next-token distribution: one padded pass."""
    seqs = [s.ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs])
    attn = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)
    return logits.gather(-1, ids[:, 1:, None])[..., 0], -(logits.exp() * logits).sum(-1)


def reference(model, samples, algo: str, agg: str, pad_id: int, clip: bool = True, code: bool = False) -> dict:
    """The step's gradient from the papers' formulas (LUFFY's objective; SRFT's four terms), eps = 0.2.
    ``code``: SRFT as its official code computes it (sg(e^{+H}) on the demonstrations' NLL, LUFFY's
    shaped unclipped term on their ratio)."""
    model.zero_grad(set_to_none=True)
    logp, entropy = forward(model, samples, pad_id)
    parts = {"on": [0.0, 0, 0], "demo": [0.0, 0, 0]}  # loss sum, tokens, sequences of the policy's / demonstrations'
    for i, s in enumerate(samples):
        sl = slice(len(s.prompt_ids) - 1, s.num_targets)
        lp, h, adv, old = logp[i, sl], entropy[i, sl], s.advantages[sl], s.old_logprobs[sl]
        p = lp.exp()
        if algo == "luffy" and s.source == "demonstration":
            loss = -(p / (p + 0.1) * adv)
        elif algo == "luffy":
            r = torch.exp(lp - old)
            loss = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) if clip else -r * adv
        elif s.source == "demonstration" and code:
            loss = 0.5 * torch.exp(h.detach()) * -lp - p / (p + 0.1) * adv
        elif s.source == "demonstration":
            loss = 0.5 * torch.exp(-h.detach()) * -lp - torch.minimum(p * adv, p.clamp(0.8, 1.2) * adv)
        else:
            loss = 0.1 * torch.exp(h.detach()) * -lp if s.reward >= 1.0 else lp
        key = "demo" if s.source == "demonstration" and algo == "srft" else "on"
        parts[key] = [parts[key][0] + loss.sum(), parts[key][1] + len(loss), parts[key][2] + 1]
    if agg == "token-mean":
        total = sum(v[0] / v[1] for v in parts.values() if v[1])
    else:  # LUFFY's code: the loss sum over a constant length per sequence
        total = sum(v[0] / (v[2] * NORM_LEN) for v in parts.values() if v[1])
    total.backward()
    out = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def exactrl_step(model, samples, cfg: RLConfig, pad_id: int, sort: bool):
    """The step's micro-batch backwards through train_rl's path (not yet stepped)."""
    model = copy.deepcopy(model)
    engine = build_engine(model, cfg, total_steps=1)
    objective = ALGORITHMS.lookup(cfg.algo.name).objective(cfg)
    t = cfg.train
    plan = plan_samples(samples, t.micro_batch_size, t.loss_agg, t.loss_agg_norm, sort=sort)
    worker = Worker("policy", model, engine, pad_id=pad_id, packed=t.padding_free)
    normalizers, metrics = objective.normalizers(plan), Metrics()
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share, _ = worker.micro_batch([samples[i] for i in mb], objective, normalizers, metrics)
        engine.backward(loss, share, num_samples=len(mb))
    return {n: q.grad.detach().clone() for n, q in model.named_parameters()}, plan, engine


def rel_err(got: dict, ref: dict) -> float:
    diff = sum(((got[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    return (diff / sum((ref[k].double() ** 2).sum() for k in ref)).sqrt().item()


SRFT_CODE = ("algo.srft.sft_weight=exp_entropy", "algo.srft.demo_gamma=0.1", "algo.srft.demo_clip=false")


def cfg_for(algo: str, k: int, agg: str = "token-mean", *extra: str) -> RLConfig:
    return load_config(RLConfig, None, [f"algo.name={algo}", "algo.group_size=4", "train.global_batch_size=8",
                                        f"train.micro_batch_size={8 // k}", "train.max_grad_norm=0",
                                        f"train.loss_agg={agg}", "optim.name=sgd", "optim.lr=1",
                                        "optim.scheduler=constant", *extra]
                       + ([f"train.loss_agg_norm={NORM_LEN}"] if agg != "token-mean" else []))


@pytest.mark.parametrize("sort", [False, True], ids=["in-order", "by-length"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("algo,agg,extra", [("luffy", "token-mean", ()),
                                            ("luffy", "seq-mean-token-sum-norm", ("algo.luffy.clip=false",)),
                                            ("srft", "token-mean", ()), ("srft", "token-mean", SRFT_CODE)],
                         ids=["luffy-paper", "luffy-code", "srft-paper", "srft-code"])
def test_mixed_step_gradient_is_the_full_batch_gradient(algo, agg, extra, k, sort, batch, make_model, tokenizer):
    pad_id = tokenizer.pad_token_id
    model = make_model(0)
    ref = reference(model, batch, algo, agg, pad_id, clip="algo.luffy.clip=false" not in extra,
                    code=extra == SRFT_CODE)
    got, plan, engine = exactrl_step(model, batch, cfg_for(algo, k, agg, *extra), pad_id, sort)
    assert rel_err(got, ref) <= TOL
    shares = {sum(batch[i].loss_tokens for i in mb if batch[i].source == "demonstration")
              / sum(batch[i].loss_tokens for i in mb) for mb in plan.micro_batches}
    assert k == 1 or len(shares) > 1  # micro-batches hold different shares of demonstration tokens
    assert engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)


def test_a_mean_of_micro_batch_means_is_not_the_full_batch_gradient(batch, make_model, tokenizer):
    """What the check catches: each micro-batch normalised by its own tokens, then averaged."""
    pad_id = tokenizer.pad_token_id
    model = make_model(0)
    ref = reference(model, batch, "luffy", "token-mean", pad_id)
    parts = [exactrl_step(model, [batch[i] for i in mb], cfg_for("luffy", 1), pad_id, False)[0]
             for mb in ([0, 1, 2, 3], [4, 5, 6, 7])]
    means = {n: (parts[0][n] + parts[1][n]) / 2 for n in ref}
    assert rel_err(means, ref) > 1e-2
