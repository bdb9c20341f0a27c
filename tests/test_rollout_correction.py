"""The rollout-trainer gap's corrections (algo.rollout_correction): each estimator, in both forms,
against its closed form written out per token (value and gradient), the normaliser that keeps
masked tokens, the accumulated-vs-full-batch gradient with micro-batches holding very different
shares of masked tokens, and the settings refused because they cannot act."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from exactrl.config import ConfigError, RLConfig, load_config
from exactrl.config.schema import OptimConfig, TrainConfig
from exactrl.config.schema_rl import AlgoConfig, RolloutConfig
from exactrl.data.batch import ORIGINS, Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.aggregation import StepNormalizer, aggregate
from exactrl.losses.objective import Metrics, PolicyTerm
from exactrl.losses.rollout_gap import RolloutGap
from rl_helpers import policy_micro_batch_loss
from test_grad_equivalence import ADVANTAGES, RL_DATA, TEMPERATURE, grads, pad, reduce_by_definition, rel_err

CASES = [(c, f) for c in ("tis", "icepop", "seq_mask") for f in ("decoupled", "folded")]
EPS = 0.2


def weight(correction: str, rho: float, geo: float, cap: float, cap_low: float) -> float:
    """w(rho) as the papers write it: TIS min(rho, C); masked IS rho inside the band, else 0."""
    if correction == "tis":
        return min(rho, cap)
    inside = 1 / cap_low <= (geo if correction == "seq_mask" else rho) <= cap
    return rho if inside else 0.0


def closed_form(logp, old, gen, adv, mask, origin, correction, form, cap, cap_low):
    """The corrected PPO loss, token-mean over every loss token (masked ones too), and its gradient
    with respect to logp, token by token in plain Python."""
    n = sum(map(sum, mask))
    loss, grad = 0.0, [[0.0] * len(row) for row in logp]
    for b, row in enumerate(logp):
        sampled = [t for t in range(len(row)) if mask[b][t] and origin[b][t] == "policy"]
        ref = old[b] if form == "decoupled" else row  # rho: the old pass's, or this forward's
        geo = math.exp(sum(ref[t] - gen[b][t] for t in sampled) / max(len(sampled), 1))
        for t in range(len(row)):
            if not mask[b][t]:
                continue
            factor, anchor = 1.0, old[b][t]
            if t in sampled:
                rho = math.exp(ref[t] - gen[b][t])
                w = weight(correction, rho, geo, cap, cap_low)
                factor = w if form == "decoupled" else w / rho
                anchor = old[b][t] if form == "decoupled" else gen[b][t]
            r, a = math.exp(row[t] - anchor), adv[b][t]
            surrogate = min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a)
            loss -= factor * surrogate / n
            if r * a <= min(max(r, 1 - EPS), 1 + EPS) * a:  # the unclipped branch carries the gradient
                grad[b][t] = -factor * a * r / n
    return loss, grad


def hand_made():
    """Three rows whose gaps log(old / gen) cross every bound of the tests: per token rho from 0.11
    to 7.4, and the sampled tokens' mean log-ratio +0.8, 0 and -0.8 per row (rows 0 and 2 outside
    seq_mask's band of the test); old log-probs off the current ones (a later PPO epoch), so the
    ratio and its clip act too; padding in row 1 and a demonstration-origin token (a hint) in row 2."""
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(3, 6, generator=g, dtype=torch.float64) - 0.2
    old = logp + 0.25 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    gap = torch.tensor([[1.5, -0.2, 0.9, 2.0, 0.1, 0.5], [0.3, -0.9, 1.0, -0.4, 0.7, -2.0],
                        [-1.2, 3.0, -0.1, -2.2, 0.4, -0.9]], dtype=torch.float64)
    gen = old - gap
    adv = torch.tensor([[1.0], [-0.8], [0.6]], dtype=torch.float64).expand(3, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0], [1] * 6])
    origin = [["policy"] * 6, ["policy"] * 6, ["policy", "demonstration"] + ["policy"] * 4]
    return logp, old, gen, adv, mask, origin


@pytest.mark.parametrize("correction,form", CASES)
def test_each_correction_against_its_closed_form_value_and_gradient(correction, form):
    logp, old, gen, adv, mask, origin = hand_made()
    cap, cap_low = (1.5, 1.5) if correction == "seq_mask" else (2.0, 1.6)
    term = PolicyTerm(gap=RolloutGap(correction=correction, form=form, cap=cap, cap_low=cap_low))
    x = logp.clone().requires_grad_()
    b = {"old_logprobs": old, "gen_logprobs": gen, "advantages": adv,
         "origin": torch.tensor([[ORIGINS.index(o) for o in row] for row in origin])}
    m = Metrics()
    tok = term.token_loss({"logprobs": x}, b, mask, m)
    got = aggregate(tok, mask, StepNormalizer("token-mean", num_tokens=int(mask.sum()), num_seqs=3))
    (grad,) = torch.autograd.grad(got, x)
    want, want_grad = closed_form(logp.tolist(), old.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), origin,
                                  correction, form, cap, cap_low)
    assert got.item() == pytest.approx(want, rel=1e-12)
    assert grad.flatten().tolist() == pytest.approx([g for row in want_grad for g in row], rel=1e-12, abs=1e-15)
    # every branch acts: some sampled tokens corrected and some not, some ratios clipped
    frac = m.result()["rollout_correction/corrected_frac"]
    assert 0.1 < frac < 0.9 and 0.0 < m.result()["clip_frac"] < 1.0


def test_a_masked_token_stays_in_the_normaliser():
    """IcePop's, TIS's and masked IS's estimators average over every sampled token: a masked token
    adds 0 to the sum and 1 to the count (token-mean's T)."""
    logp, old, gen, adv, mask, origin = hand_made()
    b = {"old_logprobs": old, "gen_logprobs": gen, "advantages": adv,
         "origin": torch.tensor([[ORIGINS.index(o) for o in row] for row in origin])}
    gap = RolloutGap(correction="icepop", cap=2.0, cap_low=1.6)
    tok = PolicyTerm(gap=gap).token_loss({"logprobs": logp}, b, mask, Metrics())
    plain = PolicyTerm().token_loss({"logprobs": logp}, b, mask, Metrics())
    rho = torch.exp(old - gen)
    kept = (rho >= 1 / 1.6) & (rho <= 2.0)
    hint = b["origin"] == ORIGINS.index("demonstration")  # never sampled: its loss is left as it is
    assert 0 < int((mask * ~kept * ~hint).sum()) < int(mask.sum())  # masked tokens among the loss tokens
    normalizer = StepNormalizer("token-mean", num_tokens=int(mask.sum()), num_seqs=3)
    want = (plain * torch.where(hint, 1.0, rho * kept) * mask).sum() / mask.sum()
    assert aggregate(tok, mask, normalizer).item() == pytest.approx(want.item(), rel=1e-12)


# ---------------------------------------------------------------- accumulated vs full batch

# per sample, log(old / gen) ~ offset + scale x N(0, 1) per token: the first four far off (whole
# sequences outside [1/2, 2] too), the last four near 0
GAPS = [(1.2, 1.0), (-1.2, 1.0), (1.0, 1.0), (-1.0, 1.0), (0.0, 0.0), (0.0, 0.02), (0.0, 0.0), (0.0, 0.02)]


def gap_samples(model, tokenizer) -> list[Sample]:
    """RL_DATA's uneven responses with old log-probs near the model's and generator log-probs off
    them by GAPS: micro-batches of the first half have many tokens corrected, of the second half none."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for (prompt, response), adv in zip(RL_DATA, ADVANTAGES):
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(Sample(p, r, advantages=torch.tensor([0.0] * (len(p) - 1) + [adv] * len(r))))
    seqs = [s.ids for s in samples]
    ids, attn = pad(seqs, tokenizer.pad_token_id), pad([[1] * len(s) for s in seqs], 0)
    with torch.no_grad():
        lp = (model(input_ids=ids, attention_mask=attn).logits[:, :-1] / TEMPERATURE).log_softmax(-1).gather(
            -1, ids[:, 1:, None])[..., 0]
    for s, row, (offset, scale) in zip(samples, lp, GAPS):
        old = row[: s.num_targets] + 0.2 * torch.randn(s.num_targets, generator=g)
        s.old_logprobs = old
        s.gen_logprobs = old - (offset + scale * torch.randn(s.num_targets, generator=g)) * torch.tensor(s.loss_mask)
    return samples


def reference(model, samples, mode, correction, form, pad_id):
    """One padded forward over the whole batch, the corrected loss written out in torch, reduced by
    the mode's definition."""
    seqs = [s.ids for s in samples]
    ids, attn = pad(seqs, pad_id), pad([[1] * len(s) for s in seqs], 0)
    mask = pad([list(s.loss_mask) for s in samples], 0).double()
    old = pad([s.old_logprobs.tolist() for s in samples], 0.0)
    gen = pad([s.gen_logprobs.tolist() for s in samples], 0.0)
    adv = pad([s.advantages.tolist() for s in samples], 0.0)
    model.zero_grad(set_to_none=True)
    logp = (model(input_ids=ids, attention_mask=attn).logits[:, :-1] / TEMPERATURE).log_softmax(-1).gather(
        -1, ids[:, 1:, None])[..., 0]
    log_rho = ((old if form == "decoupled" else logp.detach()) - gen) * mask
    rho = torch.exp(log_rho)
    if correction == "tis":
        w = rho.clamp(max=2.0)
    else:
        geo = torch.exp(log_rho.sum(1, keepdim=True) / mask.sum(1, keepdim=True))
        measured = geo.expand_as(rho) if correction == "seq_mask" else rho
        w = rho * ((measured >= 0.5) & (measured <= 2.0))
    r = torch.exp(logp - (old if form == "decoupled" else gen))
    factor = torch.ones_like(rho) if correction == "none" else w if form == "decoupled" else w / rho
    tok = -factor * torch.minimum(r * adv, r.clamp(1 - EPS, 1 + EPS) * adv)
    reduce_by_definition(tok, mask, mode).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out, ((w != rho) & (mask > 0)).double()


def cfg_for(n: int, k: int, mode: str, correction: str, form: str) -> RLConfig:
    return RLConfig(train=TrainConfig(global_batch_size=n, micro_batch_size=n // k, max_grad_norm=0.0, loss_agg=mode),
                    optim=OptimConfig(name="sgd", lr=1.0, scheduler="constant"),
                    rollout=RolloutConfig(temperature=TEMPERATURE),
                    algo=AlgoConfig(name="grpo", group_size=2, clip_eps=EPS, rollout_correction=correction,
                                    rollout_correction_form=form, rollout_correction_cap=2.0,
                                    rollout_correction_cap_low=None if correction == "tis" else 2.0))


@pytest.fixture(scope="module")
def gap_batch(make_model, tokenizer):
    """The model and its samples, and each case's full-batch reference (computed once)."""
    base = make_model(11)
    samples, cache = gap_samples(base, tokenizer), {}

    def ref(n, mode, correction, form):
        if (n, mode, correction, form) not in cache:
            cache[n, mode, correction, form] = reference(copy.deepcopy(base), samples[:n], mode, correction, form,
                                                         tokenizer.pad_token_id)
        return cache[n, mode, correction, form]

    return base, samples, ref


@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (6, 3)], ids=["B8-K1", "B8-K2", "B6-K3"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("correction,form", CASES)
def test_a_corrected_step_accumulates_to_the_full_batch_gradient(correction, form, mode, n, k, gap_batch, tokenizer):
    base, samples, full_batch = gap_batch
    samples = samples[:n]
    ref, corrected = full_batch(n, mode, correction, form)
    assert rel_err(ref, full_batch(n, mode, "none", "decoupled")[0]) > 1e-3  # the correction changes the gradient
    shares = (corrected.sum(1) / pad([list(s.loss_mask) for s in samples], 0).sum(1)).tolist()
    assert max(shares[:4]) > 0.3 and max(shares[4:]) < 0.1  # micro-batches with very different corrected shares
    cfg = cfg_for(n, k, mode, correction, form)
    model = copy.deepcopy(base)
    engine = build_engine(model, cfg, total_steps=1)
    plan = plan_step([len(s.response_ids) for s in samples], n // k, mode)
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share, _ = policy_micro_batch_loss(model, engine, [samples[i] for i in mb], plan.normalizer, cfg,
                                                 tokenizer.pad_token_id)
        engine.backward(loss, share, num_samples=len(mb))
    assert rel_err(grads(model), ref) <= 1e-5
    assert engine.step(plan)["micro_batches"] == k


# ---------------------------------------------------------------- settings that cannot act


@pytest.mark.parametrize("overrides,says", [
    (["algo.rollout_correction_cap=3"], "algo.rollout_correction=none"),
    (["algo.rollout_correction_form=folded"], "algo.rollout_correction=none"),
    (["algo.rollout_correction=tis", "algo.rollout_correction_cap_low=2"], "tis truncates from above"),
    (["algo.name=srft", "algo.rollout_correction=icepop"], "srft's loss takes no ratio"),
    (["algo.name=uft", "algo.rollout_correction=tis"], "carry no generator log-probs"),
    (["algo.name=prefix_rft", "algo.rollout_gap_cap=3"], "carry no generator log-probs"),
])
def test_settings_that_cannot_act_are_refused(overrides, says):
    with pytest.raises(ConfigError, match="has no effect") as info:
        load_config(RLConfig, None, overrides)
    assert says in str(info.value)


def test_each_corrections_default_caps_come_from_its_source():
    from exactrl.algorithms.registry import gap_spec

    def caps(*overrides):
        gap = gap_spec(load_config(RLConfig, None, list(overrides)))
        return gap.correction, gap.cap, gap.cap_low

    assert caps("algo.rollout_correction=tis") == ("tis", 2.0, 2.0)
    assert caps("algo.rollout_correction=icepop") == ("icepop", 5.0, 2.0)
    assert caps("algo.rollout_correction=seq_mask") == ("seq_mask", 3.0, 3.0)
    assert caps("algo.rollout_correction=seq_mask", "algo.rollout_correction_cap=4") == ("seq_mask", 4.0, 4.0)
    assert caps("algo.rollout_correction=icepop", "algo.rollout_correction_cap_low=3") == ("icepop", 5.0, 3.0)
