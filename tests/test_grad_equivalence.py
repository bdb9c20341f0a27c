"""The product's promise: the gradient an optimizer step applies is the full-batch gradient,
whatever the split into micro-batches.

Reference: ONE forward/backward over the whole global batch padded together, with the
per-token losses computed here with torch ops and reduced by each mode's definition written
out below (no exactrl loss or aggregation code). exactrl path: plan_step, the algorithm's own
micro-batch loss function and engine.backward per micro-batch, as the training loops do.
Uneven sequence lengths make micro-batches carry very different token counts, which is what
exposes a "mean of means" (OpenRLHF <= 0.9.10) or a dropped micro-batch (DeepSpeed ZeRO-1/2
CPU offload with K >= 3, PR #6550 -> #7967).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from exactrl.config.schema import OptimConfig, SFTConfig, TrainConfig
from exactrl.config.schema_rl import AlgoConfig, RLConfig, RolloutConfig
from exactrl.data.batch import Sample
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import SampleAccountingError, build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.aggregation import AGG_MODES
from exactrl.tasks.arithmetic import Problem, worked_solution
from rl_helpers import policy_micro_batch_loss, sft_micro_batch_loss

NORM_LEN = 64.0
TOL = 1e-5  # fp32: relative error of the whole gradient (all parameters as one vector)
# (global batch, K micro-batches): K in {1, 2, 3, 4, 8}.
SPLITS = [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3)]

# Completions from 1 to ~60 characters (one token per character): deliberately uneven.
SFT_ROWS = [
    {"prompt": "12+3=", "completion": "#### 15"},
    {"prompt": "347+285=", "completion": worked_solution(Problem(347, 285))},
    {"prompt": "1+1=", "completion": "2"},
    {"prompt": "123456+654321=", "completion": worked_solution(Problem(123456, 654321))},
    {"prompt": "5+5=", "completion": "#### 10"},
    {"prompt": "99999+1=", "completion": worked_solution(Problem(99999, 1))},
    {"prompt": "7+8=", "completion": worked_solution(Problem(7, 8))},
    {"prompt": "40+2=", "completion": "#### 42"},
]


# ---------------------------------------------------------------- independent references


def reduce_by_definition(tok_loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Each mode as defined in DESIGN.md, over one padded [B, T] batch holding the whole step."""
    mask = mask.to(tok_loss.dtype)
    seq_sum = (tok_loss * mask).sum(1)
    if mode == "token-mean":
        return seq_sum.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(1)).mean()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    assert mode == "seq-mean-token-sum-norm"
    return seq_sum.sum() / (tok_loss.size(0) * NORM_LEN)


def pad(rows: list[list], value) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows])


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    diff = sum(((got[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    norm = sum((ref[k].double() ** 2).sum() for k in ref)
    return (diff / norm).sqrt().item()


def sft_reference(model, examples, mode: str, pad_id: int) -> dict[str, torch.Tensor]:
    ids = pad([e.input_ids for e in examples], pad_id)
    attn = pad([[1] * len(e.input_ids) for e in examples], 0)
    # Target t is ids[t + 1]; it counts when the token ids[t + 1] is a completion token.
    mask = pad([e.loss_mask[1:] for e in examples], 0)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                          reduction="none").view(mask.shape)
    reduce_by_definition(nll, mask, mode).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


# ---------------------------------------------------------------- the exactrl path


def sft_cfg(n: int, k: int, mode: str, max_grad_norm: float = 0.0) -> SFTConfig:
    return SFTConfig(train=TrainConfig(global_batch_size=n, micro_batch_size=n // k, max_grad_norm=max_grad_norm,
                                       loss_agg=mode, loss_agg_norm=NORM_LEN),
                     optim=OptimConfig(name="sgd", lr=1.0, scheduler="constant"))


def sft_exactrl(model, examples, cfg: SFTConfig, pad_id: int, group_by_length: bool = True, skip: int | None = None):
    """Accumulate the step's gradient as train_sft does; returns (engine, plan)."""
    t = cfg.train
    engine = build_engine(model, cfg, total_steps=1)
    lengths = [len(e.input_ids) for e in examples] if group_by_length else None
    plan = plan_step([e.loss_tokens for e in examples], t.micro_batch_size, t.loss_agg, t.loss_agg_norm,
                     lengths=lengths)
    engine.begin_step(len(plan.micro_batches))
    for j, mb in enumerate(plan.micro_batches):
        if j == skip:
            continue
        loss, share = sft_micro_batch_loss(model, engine, [examples[i] for i in mb], pad_id, plan.normalizer)
        engine.backward(loss, share, num_samples=len(mb))
    return engine, plan


@pytest.fixture(scope="module")
def sft_examples(tokenizer):
    rows = [Row(f"rows:{i + 1}", r) for i, r in enumerate(SFT_ROWS)]
    examples = encode_sft(rows, tokenizer, max_length=128)
    counts = [e.loss_tokens for e in examples]
    assert max(counts) >= 10 * min(counts)  # the unevenness the test relies on
    return examples


@pytest.fixture(scope="module")
def base_model(make_model):
    return make_model(seed=0)


@pytest.fixture(scope="module")
def sft_refs(base_model, sft_examples, tokenizer):
    cache = {}

    def get(n: int, mode: str):
        if (n, mode) not in cache:
            cache[n, mode] = sft_reference(base_model, sft_examples[:n], mode, tokenizer.pad_token_id)
        return cache[n, mode]

    return get


@pytest.mark.parametrize("group_by_length", [True, False], ids=["length-grouped", "in-order"])
@pytest.mark.parametrize("n,k", SPLITS, ids=[f"B{n}-K{k}" for n, k in SPLITS])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_sft_accumulated_gradient_equals_full_batch_gradient(mode, n, k, group_by_length, base_model, sft_examples,
                                                             sft_refs, tokenizer):
    model = copy.deepcopy(base_model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine, plan = sft_exactrl(model, sft_examples[:n], sft_cfg(n, k, mode), tokenizer.pad_token_id, group_by_length)
    assert len(plan.micro_batches) == k
    got = grads(model)
    assert rel_err(got, sft_refs(n, mode)) <= TOL

    # The optimizer applies exactly that gradient: SGD lr=1, no clipping, no momentum.
    stats = engine.step(plan)
    assert stats["micro_batches"] == k and stats["samples"] == n
    applied = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    assert rel_err(applied, got) <= TOL
    assert rel_err(applied, sft_refs(n, mode)) <= TOL


def test_clipping_acts_on_the_full_accumulated_gradient(base_model, sft_examples, sft_refs, tokenizer):
    ref = sft_refs(8, "token-mean")
    ref_norm = sum((g.double() ** 2).sum() for g in ref.values()).sqrt().item()
    model = copy.deepcopy(base_model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine, plan = sft_exactrl(model, sft_examples, sft_cfg(8, 4, "token-mean", max_grad_norm=ref_norm / 2),
                               tokenizer.pad_token_id)
    stats = engine.step(plan)
    assert stats["grad_norm"] == pytest.approx(ref_norm, rel=TOL)
    applied = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    assert rel_err(applied, {name: g / 2 for name, g in ref.items()}) <= TOL


def test_mean_of_means_fails_the_equivalence_check(base_model, sft_examples, sft_refs, tokenizer):
    """The comparison above has teeth: the OpenRLHF <= 0.9.10 reduction (token mean per
    micro-batch, then the mean of those) is far outside the tolerance on this data."""
    model = copy.deepcopy(base_model)
    pad_id = tokenizer.pad_token_id
    micro = [sft_examples[i : i + 2] for i in range(0, 8, 2)]
    for mb in micro:
        ids, mask = pad([e.input_ids for e in mb], pad_id), pad([e.loss_mask[1:] for e in mb], 0)
        attn = pad([[1] * len(e.input_ids) for e in mb], 0)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                              reduction="none").view(mask.shape)
        ((nll * mask).sum() / mask.sum() / len(micro)).backward()
    assert rel_err(grads(model), sft_refs(8, "token-mean")) > 1e-3


def test_dropped_middle_micro_batches_fail_the_equivalence_check(base_model, sft_examples, sft_refs, tokenizer):
    """(g_first + g_last) with K = 4, the DeepSpeed CPU-offload symptom, is caught."""
    model = copy.deepcopy(base_model)
    cfg = sft_cfg(8, 4, "token-mean")
    engine = build_engine(model, cfg, total_steps=1)
    plan = plan_step([e.loss_tokens for e in sft_examples], 2, "token-mean")
    engine.begin_step(len(plan.micro_batches))
    for j, mb in enumerate(plan.micro_batches):
        loss, share = sft_micro_batch_loss(model, engine, [sft_examples[i] for i in mb], tokenizer.pad_token_id,
                                           plan.normalizer)
        engine.backward(loss if j in (0, 3) else loss * 0.0, share, num_samples=len(mb))
    assert rel_err(grads(model), sft_refs(8, "token-mean")) > 1e-3


def test_middle_micro_batch_contributes_to_the_gradient(base_model, sft_examples, tokenizer):
    """Changing only the data of micro-batch 1 of 4 changes the accumulated gradient."""
    changed = list(sft_examples)
    changed[2:4] = encode_sft([Row("alt:1", {"prompt": "1+1=", "completion": "#### 2 and then some more text"}),
                               Row("alt:2", {"prompt": "123456+654321=", "completion": "#### 777777"})],
                              tokenizer, max_length=128)
    out = []
    for examples in (sft_examples, changed):
        model = copy.deepcopy(base_model)
        sft_exactrl(model, examples, sft_cfg(8, 4, "token-mean"), tokenizer.pad_token_id, group_by_length=False)
        out.append(grads(model))
    assert rel_err(out[1], out[0]) > 1e-3


def test_skipped_backward_raises_sample_accounting_error(base_model, sft_examples, tokenizer):
    model = copy.deepcopy(base_model)
    engine, plan = sft_exactrl(model, sft_examples, sft_cfg(8, 4, "token-mean"), tokenizer.pad_token_id, skip=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(SampleAccountingError, match="planned 4 micro-batches / 8 samples, backward saw 3 / 6"):
        engine.step(plan)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing applied


def test_repeated_backward_raises_sample_accounting_error(base_model, sft_examples, tokenizer):
    model = copy.deepcopy(base_model)
    engine, plan = sft_exactrl(model, sft_examples, sft_cfg(8, 2, "token-mean"), tokenizer.pad_token_id)
    mb = plan.micro_batches[0]
    loss, share = sft_micro_batch_loss(model, engine, [sft_examples[i] for i in mb], tokenizer.pad_token_id,
                                       plan.normalizer)
    with pytest.raises(SampleAccountingError, match="backward of micro-batch 3 in a step begun with 2"):
        engine.backward(loss, share, num_samples=len(mb))


# ---------------------------------------------------------------- GRPO

CLIP_EPS = 0.2
TEMPERATURE = 0.8
ADVANTAGES = [1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 2.0, -1.0]
RL_DATA = [  # (prompt, response as if generated): response lengths 2 to ~60 tokens
    ("12+3=", "#### 15"),
    ("347+285=", worked_solution(Problem(347, 285))),
    ("1+1=", "2"),
    ("123456+654321=", worked_solution(Problem(123456, 654321))),
    ("5+5=", "10 #### 10"),
    ("99999+1=", worked_solution(Problem(99999, 1))),
    ("7+8=", worked_solution(Problem(7, 8))),
    ("40+2=", "#### 42"),
]


def rl_logprobs(model, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """log p(x[t+1] | x[..t]) at TEMPERATURE, for one padded batch: [B, L-1]."""
    ids = pad(seqs, pad_id)
    attn = pad([[1] * len(s) for s in seqs], 0)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def rl_samples(base_model, tokenizer):
    """Samples with per-token old and reference log-probs; both are the policy's own
    log-probs perturbed by seeded noise, so ratios differ from 1 and clipping is active."""
    pad_id = tokenizer.pad_token_id
    samples = []
    for (prompt, response), adv in zip(RL_DATA, ADVANTAGES):
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(Sample(p, r, reward=0.0, advantages=torch.tensor([0.0] * (len(p) - 1) + [adv] * len(r))))
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    with torch.no_grad():
        lp = rl_logprobs(base_model, seqs, pad_id)
    g = torch.Generator().manual_seed(1)
    old = lp + 0.3 * torch.randn(lp.shape, generator=g)
    ref = lp + 0.3 * torch.randn(lp.shape, generator=g)
    for s, seq, o, r in zip(samples, seqs, old, ref):
        s.old_logprobs, s.ref_logprobs = o[: len(seq) - 1].clone(), r[: len(seq) - 1].clone()
    return samples


def grpo_reference(model, samples, mode: str, kl_coef: float, pad_id: int, algo: str = "grpo",
                   clip: tuple[float, float] = (CLIP_EPS, CLIP_EPS)) -> tuple[dict, float]:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    # Target t is seq[t + 1]: a response token for t in [len(prompt) - 1, len(seq) - 1).
    mask = pad([[0] * (len(s.prompt_ids) - 1) + [1] * len(s.response_ids) for s in samples], 0)
    old = pad([s.old_logprobs.tolist() for s in samples], 0.0)
    ref = pad([s.ref_logprobs.tolist() for s in samples], 0.0)
    adv = torch.tensor(ADVANTAGES[: len(samples)])[:, None]
    model.zero_grad(set_to_none=True)
    logp = rl_logprobs(model, seqs, pad_id)
    if algo == "gspo":  # one ratio per sequence: the geometric mean of its token ratios (arXiv 2507.18071)
        ratio = (((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).exp().expand_as(logp)
    else:
        ratio = (logp - old).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv)
    log_r = ref - logp
    k3 = log_r.exp() - 1 - log_r
    loss = -surrogate + kl_coef * k3
    reduce_by_definition(loss, mask, mode).backward()
    clipped = ((ratio * adv != surrogate) & (mask == 1)).sum().item() / mask.sum().item()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out, clipped


def rl_cfg(n: int, k: int, mode: str, kl_coef: float, algo: str = "grpo", clip: tuple[float, float] = (
    CLIP_EPS, CLIP_EPS)) -> RLConfig:
    return RLConfig(train=TrainConfig(global_batch_size=n, micro_batch_size=n // k, max_grad_norm=0.0, loss_agg=mode,
                                      loss_agg_norm=NORM_LEN),
                    optim=OptimConfig(name="sgd", lr=1.0, scheduler="constant"),
                    rollout=RolloutConfig(temperature=TEMPERATURE),
                    algo=AlgoConfig(name=algo, group_size=2, clip_eps=clip[0], clip_eps_high=clip[1], kl_coef=kl_coef,
                                    kl_estimator="k3"))


def accumulate_policy_loss(base_model, batch, cfg: RLConfig, pad_id: int):
    """One step's micro-batch backwards through train_rl's path, on a copy of the model (not yet stepped)."""
    model = copy.deepcopy(base_model)
    engine = build_engine(model, cfg, total_steps=1)
    # As train_rl plans a step: loss tokens are the response lengths.
    plan = plan_step([len(s.response_ids) for s in batch], cfg.train.micro_batch_size, cfg.train.loss_agg, NORM_LEN)
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share, _ = policy_micro_batch_loss(model, engine, [batch[i] for i in mb], plan.normalizer, cfg, pad_id)
        engine.backward(loss, share, num_samples=len(mb))
    return model, engine, plan


@pytest.fixture(scope="module")
def grpo_refs(base_model, rl_samples, tokenizer):
    cache = {}

    def get(n: int, mode: str, kl_coef: float, algo: str = "grpo", clip: tuple[float, float] = (CLIP_EPS, CLIP_EPS)):
        key = (n, mode, kl_coef, algo, clip)
        if key not in cache:
            cache[key] = grpo_reference(base_model, rl_samples[:n], mode, kl_coef, tokenizer.pad_token_id, algo, clip)
        return cache[key]

    return get


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no-kl", "kl"])
@pytest.mark.parametrize("n,k", SPLITS, ids=[f"B{n}-K{k}" for n, k in SPLITS])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_accumulated_gradient_equals_full_batch_gradient(mode, n, k, kl_coef, base_model, rl_samples, grpo_refs,
                                                              tokenizer):
    ref, clip_frac = grpo_refs(n, mode, kl_coef)
    assert 0.05 < clip_frac < 0.95  # the clipped branch is exercised
    model, engine, plan = accumulate_policy_loss(base_model, rl_samples[:n], rl_cfg(n, k, mode, kl_coef),
                                                 tokenizer.pad_token_id)
    assert rel_err(grads(model), ref) <= TOL
    assert engine.step(plan)["micro_batches"] == k


@pytest.mark.parametrize("n,k", [(8, 1), (8, 4), (6, 3)], ids=["B8-K1", "B8-K4", "B6-K3"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("algo,clip", [("gspo", (0.05, 0.06)), ("grpo", (0.2, 0.28))], ids=["gspo", "dapo-clip-higher"])
def test_other_policy_losses_accumulate_to_the_full_batch_gradient(algo, clip, mode, n, k, base_model, rl_samples,
                                                                   grpo_refs, tokenizer):
    """GSPO's sequence-level ratio (with a small clip range, as GSPO uses: whole sequences are
    clipped) and the asymmetric clip, against the definitions written out in grpo_reference
    (one padded pass over the whole batch)."""
    ref, clip_frac = grpo_refs(n, mode, 0.0, algo, clip)
    assert 0.0 < clip_frac < 1.0  # both branches exercised
    model, _, _ = accumulate_policy_loss(base_model, rl_samples[:n], rl_cfg(n, k, mode, 0.0, algo, clip),
                                         tokenizer.pad_token_id)
    assert rel_err(grads(model), ref) <= TOL
    assert rel_err(ref, grpo_refs(n, mode, 0.0)[0]) > 1e-3  # and it is not the plain GRPO gradient


def test_grpo_kl_term_changes_the_gradient(grpo_refs):
    """The KL reference run differs from the plain one, so the kl cases test the KL term."""
    assert rel_err(grpo_refs(8, "token-mean", 0.1)[0], grpo_refs(8, "token-mean", 0.0)[0]) > 1e-3
