"""UFT and Prefix-RFT (issue 23): their hint/prefix schedules, their losses against the papers'
formulas on hand-made tensors, the exact step gradient over micro-batches holding different
shares of prefix and policy tokens, and the hinted rollout's samples.

References are written here from the papers' definitions in plain torch (masks built from the
written-out origins, the entropy selection by an independent ranking), never by calling the code
under test."""

from __future__ import annotations

import math
import random

import pytest
import torch

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config import ConfigError, RLConfig, SFTConfig, load_config
from exactrl.config.methods import names
from exactrl.data.batch import Sample, collate
from exactrl.data.encode import Prompt
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Metrics, micro_batch_loss
from exactrl.losses.prefix import top_entropy_tokens
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.hinted import prefix_length, prefix_low, uft_hint_length, uft_hint_share, uft_rollout
from exactrl.workers.worker import Worker


class Draws:
    """A stand-in for random.Random whose draws are written out."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_uft_hint_share_follows_the_codes_cosine_then_stops():
    """p(t) = low + (high - low)(1 + cos(pi t / T)) / 2 up to T, then no hint (liumy2010/UFT)."""
    shares = [uft_hint_share(t, 0.05, 0.95, 300) for t in (0, 75, 150, 225, 300, 301)]
    assert shares == pytest.approx([0.95, 0.05 + 0.45 * (1 + math.sqrt(0.5)), 0.5, 0.05 + 0.45 * (1 - math.sqrt(0.5)),
                                    0.05, 0.0], abs=1e-12)


def test_uft_hint_length_is_binomial_parts_of_the_demonstration_without_its_last_token():
    # 21 tokens (20 and EOS), 5 parts of 4: draws below the share 0.5 count -> k = 3 -> 12 tokens
    assert uft_hint_length(21, 5, 0.5, Draws([0.1, 0.6, 0.3, 0.9, 0.2])) == 12
    assert uft_hint_length(21, 5, 1.0, random.Random(0)) == 20  # never the EOS
    assert uft_hint_length(21, 5, 0.0, random.Random(0)) == 0
    assert uft_hint_length(3, 5, 1.0, random.Random(0)) == 2  # fewer tokens than parts: one part per token
    assert uft_hint_length(1, 5, 1.0, random.Random(0)) == 0  # only the EOS: no hint
    rng = random.Random(1)
    mean = sum(uft_hint_length(21, 5, 0.3, rng) for _ in range(4000)) / 4000
    assert mean == pytest.approx(0.3 * 20, abs=0.25)  # E[k] / 5 x 20


def test_prefix_rft_lower_bound_decays_along_a_cosine_and_the_length_is_uniform_between_bounds():
    """low(t) from 0.95 to 0.05 along a half cosine over 500 steps (the paper's A.2), then held;
    a prefix is int(l x length), l ~ U[low(t), 0.95], at most all but the last token."""
    lows = [prefix_low(t, 0.95, 0.05, 500) for t in (0, 250, 500, 900)]
    assert lows == pytest.approx([0.95, 0.5, 0.05, 0.05], abs=1e-12)
    assert prefix_length(40, 0.05, 0.95, Draws([0.6])) == 23  # l = 0.59: 23.6 tokens
    assert prefix_length(40, 0.05, 0.95, Draws([0.2])) == 9  # l = 0.23: 9.2 tokens
    assert prefix_length(40, 0.95, 0.95, Draws([0.7])) == 38  # int(0.95 x 40)
    assert prefix_length(10, 0.95, 1.0, Draws([0.99])) == 9  # capped: the policy writes the last token
    assert prefix_length(40, 0.95, 0.05, Draws([0.0])) == 2  # bounds in either order


def test_the_highest_entropy_share_of_each_rows_prefix_is_selected():
    entropy = torch.tensor([[9.0, 0.1, 0.5, 0.3, 0.2, 0.4, 7.0],
                            [0.0, 0.9, 0.1, 0.8, 0.0, 0.0, 0.0]])
    prefix = torch.tensor([[0, 1, 1, 1, 1, 1, 0],  # 5 prefix tokens: int(5 x 0.8) = 4 left out, 1 kept
                           [0, 1, 1, 1, 0, 0, 0]]).bool()  # 3: int(3 x 0.6) = 1 left out with keep 0.4, 2 kept
    assert top_entropy_tokens(entropy, prefix, 0.2)[0].tolist() == [False, False, True, False, False, False, False]
    assert top_entropy_tokens(entropy, prefix, 0.4)[1].tolist() == [False, True, False, True, False, False, False]
    assert not top_entropy_tokens(entropy, torch.zeros_like(prefix), 0.2).any()


def hand_made(origins_by_row):
    """Samples of a 2-token prompt and the written-out origins of their response targets, with
    hand-made per-token log-probs (the leaf of the gradient), old log-probs, advantages, entropies."""
    g = torch.Generator().manual_seed(7)
    samples = []
    for i, origins in enumerate(origins_by_row):
        n = 1 + len(origins)  # one prompt target, then the response's
        s = Sample([1, 2], [5] * len(origins), origin=("policy",) + tuple(origins))
        s.advantages = torch.full((n,), (-1.0) ** i * (0.5 + i))
        s.old_logprobs = -torch.rand(n, generator=g) - 0.5
        samples.append(s)
    width = max(s.num_targets for s in samples)
    logp = (-torch.rand(len(samples), width, generator=g) - 0.5).requires_grad_()
    entropy = torch.rand(len(samples), width, generator=g) * 3
    return samples, logp, entropy


ROWS = [["demonstration"] * 5 + ["policy"] * 3, ["policy"] * 4, ["demonstration"] * 3 + ["policy"] * 6,
        ["demonstration"] * 2 + ["policy"]]


def objective_loss(name, overrides, samples, logp, entropy, micro=8):
    cfg = load_config(RLConfig, None, [f"algo.name={name}", "algo.group_size=4", "train.global_batch_size=4",
                                       "train.micro_batch_size=4", *overrides])
    objective = ALGORITHMS.lookup(name).objective(cfg)
    plan = plan_samples(samples, micro, cfg.train.loss_agg, cfg.train.loss_agg_norm or cfg.rollout.max_new_tokens)
    b = collate(samples, 0)
    loss, share = micro_batch_loss(objective, {"logprobs": logp, "entropy": entropy}, b, b,
                                   [s.source for s in samples], objective.normalizers(plan), Metrics())
    return loss, share


def masks(samples, width):
    pad = lambda xs: xs + [0.0] * (width - len(xs))  # noqa: E731
    demo = torch.tensor([pad([0.0] + [float(o == "demonstration") for o in r]) for r in ROWS[: len(samples)]])
    pol = torch.tensor([pad([0.0] + [float(o == "policy") for o in r]) for r in ROWS[: len(samples)]])
    adv = torch.stack([torch.nn.functional.pad(s.advantages, (0, width - s.num_targets)) for s in samples])
    old = torch.stack([torch.nn.functional.pad(s.old_logprobs, (0, width - s.num_targets)) for s in samples])
    return demo, pol, adv, old


def clipped_surrogate(logp, old, adv, eps=0.2):
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


@pytest.mark.parametrize("nll_agg", ["token-mean", "seq-mean-token-sum"])
def test_uft_loss_is_grpo_on_the_continuation_plus_the_hint_nll(nll_agg):
    """UFT: mean over the continuation tokens of PPO's clipped surrogate, plus beta x the hint's
    NLL (mean over hint tokens, or the paper's per-hint sum averaged over hinted sequences); the
    gradient by the log-probs is that of this formula, exactly -beta / N on every hint token."""
    samples, logp, entropy = hand_made(ROWS)
    loss, share = objective_loss("uft", ["algo.uft.nll_coef=0.3", f"algo.uft.nll_agg={nll_agg}"], samples, logp,
                                 entropy)
    demo, pol, adv, old = masks(samples, logp.size(1))
    lp = logp.detach().clone().requires_grad_()
    policy = (clipped_surrogate(lp, old, adv) * pol).sum() / pol.sum()
    if nll_agg == "token-mean":
        nll = (-lp * demo).sum() / demo.sum()
    else:
        has = demo.sum(1) > 0
        nll = (-lp * demo).sum(1)[has].mean()
    expect = policy + 0.3 * nll
    expect.backward()
    loss.backward()
    assert share == pytest.approx(1.0, abs=1e-12)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-6)
    assert torch.allclose(logp.grad, lp.grad, rtol=1e-6, atol=1e-9)
    # closed form on the hint tokens: d(beta x NLL) / d log p = -beta / (hint tokens) or -beta / (hinted rows)
    n = demo.sum() if nll_agg == "token-mean" else (demo.sum(1) > 0).sum()
    assert torch.allclose(logp.grad[demo.bool()], torch.full((int(demo.sum()),), -0.3 / float(n)), rtol=1e-6)


@pytest.mark.parametrize("clip_prefix", [True, False])
def test_prefix_rft_trains_only_each_prefixs_highest_entropy_tokens(clip_prefix):
    """Prefix-RFT: PPO's clipped surrogate on every response token with the advantages of each
    prefix's tokens outside its top-20% by entropy set to zero (they stay in the normaliser),
    Dr.GRPO's constant-length normaliser (sum over tokens / (rows x max_new_tokens)); with
    clip_prefix=false the kept prefix tokens use the unclipped ratio. The gradient on a
    deselected prefix token is exactly 0."""
    samples, logp, entropy = hand_made(ROWS)
    loss, share = objective_loss("prefix_rft", ["train.loss_agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=10",
                                                f"algo.prefix_rft.clip_prefix={str(clip_prefix).lower()}"],
                                 samples, logp, entropy)
    demo, pol, adv, old = masks(samples, logp.size(1))
    kept = torch.zeros_like(demo)
    for row in range(len(samples)):  # rank the row's prefix tokens by entropy, highest first; keep n - int(0.8 n)
        idx = [t for t in range(demo.size(1)) if demo[row, t]]
        ranked = sorted(idx, key=lambda t: -float(entropy[row, t]))
        for t in ranked[: len(idx) - int(len(idx) * 0.8)]:
            kept[row, t] = 1.0
    lp = logp.detach().clone().requires_grad_()
    a = adv * (pol + kept)
    tok = clipped_surrogate(lp, old, a)
    if not clip_prefix:
        tok = torch.where(demo.bool(), -a * torch.exp(lp - old), tok)
    expect = (tok * (pol + demo)).sum() / (len(samples) * 10.0)
    expect.backward()
    loss.backward()
    assert share == pytest.approx(1.0, abs=1e-12)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-6)
    assert torch.allclose(logp.grad, lp.grad, rtol=1e-6, atol=1e-9)
    dropped = (demo - kept).bool()
    assert dropped.sum() == 7 and torch.all(logp.grad[dropped] == 0)  # 5 -> 1 kept, 3 -> 1, 2 -> 1
    if not clip_prefix:  # unclipped, a kept token always has a gradient
        assert torch.all(logp.grad[kept.bool()] != 0)


def test_prefix_rft_refuses_more_prefixed_responses_than_a_group_holds():
    cfg = load_config(RLConfig, None, ["algo.name=prefix_rft", "algo.group_size=4", "algo.prefix_rft.prefixed=5"])
    with pytest.raises(ConfigError, match="algo.prefix_rft.prefixed=5 .* more than algo.group_size=4"):
        ALGORITHMS.lookup("prefix_rft").objective(cfg)


def model_samples(tokenizer, make_model):
    """Eight prompt + response rows whose responses open with a demonstration prefix of 0 to all
    but one of their tokens, old log-probs the model's own + noise (the clip acts)."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(8):
        prompt = tokenizer(f"{i}+{i * 3}=")["input_ids"]
        resp = torch.randint(7, 20, (3 + (i * 5) % 7,), generator=g).tolist()
        h = [0, len(resp) - 1, 2, 0, 5, 1, len(resp) // 2, 3][i] % len(resp)
        s = Sample(prompt, resp, origin=("policy",) * (len(prompt) - 1) + ("demonstration",) * h + ("policy",) * (
            len(resp) - h))
        s.advantages = torch.full((s.num_targets,), float(i % 4) - 1.5)
        samples.append(s)
    model = make_model(3)
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.ids])).logits[0, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.ids[1:])[:, None])[:, 0]
            s.old_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return samples


def one_pass(model, samples, name, pad_id):
    """The step loss of ``name`` in one padded forward, from the written-out origins."""
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [pad_id] * (width - len(s.ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    pad = lambda xs: xs + [0.0] * (width - 1 - len(xs))  # noqa: E731
    demo = torch.tensor([pad([float(o == "demonstration" and t >= len(s.prompt_ids) - 1)
                              for t, o in enumerate(s.origin)]) for s in samples])
    pol = torch.tensor([pad([0.0] * (len(s.prompt_ids) - 1) + [1.0] * len(s.response_ids)) for s in samples]) - demo
    adv = torch.stack([torch.nn.functional.pad(s.advantages, (0, width - 1 - s.num_targets)) for s in samples])
    old = torch.stack([torch.nn.functional.pad(s.old_logprobs, (0, width - 1 - s.num_targets)) for s in samples])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
    if name == "uft":
        return (clipped_surrogate(logp, old, adv) * pol).sum() / pol.sum() + 0.5 * (-logp * demo).sum() / demo.sum()
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    kept = torch.zeros_like(demo)
    for row in range(len(samples)):
        idx = [t for t in range(demo.size(1)) if demo[row, t]]
        for t in sorted(idx, key=lambda t: -float(entropy[row, t]))[: len(idx) - int(len(idx) * 0.8)]:
            kept[row, t] = 1.0
    return (clipped_surrogate(logp, old, adv * (pol + kept)) * (pol + demo)).sum() / (pol + demo).sum()


@pytest.mark.parametrize("name", names(hinted=True))
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_micro_batches_of_different_prefix_shares_apply_the_one_pass_gradient(tokenizer, make_model, name, micro):
    """Rows whose prefix share runs from none to all but one token, in micro-batches of 1, of at
    most 3 (3, 3, 2) and of all 8: the applied SGD update is the one-pass gradient of the method's
    step loss and the canary is exactly 1 (a mean of micro-batch means would differ)."""
    samples = model_samples(tokenizer, make_model)
    cfg = load_config(RLConfig, None, [f"algo.name={name}", "algo.group_size=4", "train.global_batch_size=8",
                                       "train.micro_batch_size=4", "train.loss_agg=token-mean",
                                       *(["algo.uft.nll_coef=0.5"] if name == "uft" else [])])
    objective = ALGORITHMS.lookup(name).objective(cfg)
    ref = make_model(3)
    loss = one_pass(ref, samples, name, tokenizer.pad_token_id)
    loss.backward()
    model = make_model(3)
    sgd = load_config(SFTConfig, None, ["optim.name=sgd", "optim.lr=1.0", "optim.scheduler=constant",
                                        "train.max_grad_norm=0"])
    worker = Worker("policy", model, build_engine(model, sgd, total_steps=1), pad_id=tokenizer.pad_token_id)
    p0 = [p.detach().clone() for p in model.parameters()]
    result = worker.train_step(samples, plan_samples(samples, micro, "token-mean", sort=True), objective)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    for p, q, before in zip(model.parameters(), ref.parameters(), p0):
        assert torch.allclose(before - p.detach(), q.grad, rtol=1e-5, atol=1e-7)


def test_a_uft_rollout_continues_the_demonstrations_hint_whatever_the_batching(tokenizer, make_model):
    """Every response opens with its prompt's scheduled hint, the demonstration's own tokens,
    marked 'demonstration' (and only those); the group shares one hint; the rollout is the same
    decoded one row at a time or all together (keyed streams)."""
    prompts = [Prompt(tokenizer(f"{i}+{i}=")["input_ids"], f"{i}+{i}=", str(2 * i), f"d:{i}",
                      tokenizer(f"{i}+{i}={2 * i}")["input_ids"] + [tokenizer.eos_token_id]) for i in range(4)]
    cfg = load_config(RLConfig, None, ["algo.name=uft", "algo.group_size=2", "train.global_batch_size=8",
                                       "train.micro_batch_size=4", "rollout.max_new_tokens=4",
                                       "algo.uft.hint_steps=10", "reward.fn=reward_fixtures:varied"])
    from exactrl.rewards import load_rewards

    model = make_model(1)
    with load_rewards(["reward_fixtures:varied"], None) as fns:
        runs = [uft_rollout(HFEngine(model, tokenizer, batch), prompts, [0, 1, 2, 3], 0, fns, cfg)
                for batch in (1, 64)]
    (samples, stats), (again, _) = runs
    assert [(s.response_ids, s.origin) for s in samples] == [(s.response_ids, s.origin) for s in again]
    assert stats["hint_level"] == pytest.approx(0.95)
    lengths = []
    for k, s in enumerate(samples):
        p = prompts[k // 2]
        h = sum(o == "demonstration" for o in s.origin)
        assert s.prompt_ids == p.input_ids and s.response_ids[:h] == p.demonstration[:h] and h < len(p.demonstration)
        assert s.origin == ("policy",) * (len(p.input_ids) - 1) + ("demonstration",) * h + ("policy",) * (
            len(s.response_ids) - h)
        assert s.gen_logprobs is None  # the trainer computes the old log-probs, prefix included
        lengths.append(h)
    assert lengths[0::2] == lengths[1::2] and any(lengths)  # one hint per group
    assert stats["hint_tokens"] == pytest.approx(sum(lengths) / len(lengths))


def test_a_prefix_rft_rollout_is_the_same_split_over_two_ranks(tokenizer, make_model, monkeypatch):
    """Each rank generates its half of the prompts (whole groups); what the two produce, in rank
    order, is the one-process rollout: prefix lengths and continuations come from keyed streams,
    not from a rank's position in its share (tests/test_rl_layout.py runs it through the command
    on FSDP2 x 2 in its slow matrix)."""
    import exactrl.rollout.hinted as hinted
    from exactrl.rewards import load_rewards

    prompts = [Prompt(tokenizer(f"{i}+{i}=")["input_ids"], f"{i}+{i}=", str(2 * i), f"d:{i}",
                      tokenizer(f"{i}+{i}={2 * i}")["input_ids"] + [tokenizer.eos_token_id]) for i in range(4)]
    cfg = load_config(RLConfig, None, ["algo.name=prefix_rft", "algo.group_size=4", "train.global_batch_size=16",
                                       "train.micro_batch_size=4", "rollout.max_new_tokens=4",
                                       "algo.prefix_rft.prefixed=2"])
    engine = HFEngine(make_model(1), tokenizer, 64)
    with load_rewards(["reward_fixtures:varied"], None) as fns:
        whole, _ = hinted.prefix_rft_rollout(engine, prompts, [0, 1, 2, 3], 1, fns, cfg)
        split = []
        for rank in (0, 1):
            monkeypatch.setattr(hinted, "shard", lambda items, r=rank: items[r * len(items) // 2 : (r + 1) * len(
                items) // 2])
            monkeypatch.setattr(hinted, "gather", lambda obj: [obj])  # this rank's own share
            split += hinted.prefix_rft_rollout(engine, prompts, [0, 1, 2, 3], 1, fns, cfg)[0]
    assert [(s.response_ids, s.origin, s.reward) for s in split] == [(s.response_ids, s.origin, s.reward)
                                                                     for s in whole]
    assert sum(any(o == "demonstration" for o in s.origin) for s in whole) == 8  # 2 of each group of 4

def test_prefix_rft_code_advantages_centre_on_the_unprefixed_responses_only():
    """advantage=code, from the official code's formula written out: a group of 4 with rewards
    1, 0, 1, 1 whose first response continues a 2-token prefix: the unprefixed mean is 2/3, so
    they get -2/3, 1/3, 1/3; the prefixed one gets 1/3 on its prefix tokens and its reward 1 on its
    continuation. A group whose only unprefixed response is the one left centres on 0. The default
    (group) leaves Dr.GRPO's group-centred advantages."""
    from exactrl.algorithms.rl import attach_advantages

    def group(rewards, prefixed):
        out = []
        for r, h in zip(rewards, prefixed):
            out.append(Sample([1, 2, 3], [7, 8, 9, 4], reward=r, origin=("policy",) * 2 + ("demonstration",) * h + (
                "policy",) * (4 - h)))
        return out

    samples = group([1.0, 0.0, 1.0, 1.0], [2, 0, 0, 0]) + group([0.0, 1.0, 1.0, 0.5], [1, 3, 1, 0])
    base = ["algo.name=prefix_rft", "algo.group_size=4", "train.global_batch_size=8", "train.micro_batch_size=4"]
    attach_advantages(samples, load_config(RLConfig, None, [*base, "algo.prefix_rft.prefixed=3",
                                                             "algo.prefix_rft.advantage=code"]))
    z = [0.0, 0.0]  # the prompt's targets
    expect = [z + [1 / 3, 1 / 3, 1, 1], z + [-2 / 3] * 4, z + [1 / 3] * 4, z + [1 / 3] * 4,
              z + [0.0, 0, 0, 0], z + [1, 1, 1, 1], z + [1, 1, 1, 1], z + [0.5] * 4]
    assert [s.advantages.tolist() for s in samples] == [pytest.approx(e, abs=1e-6) for e in expect]
    attach_advantages(samples, load_config(RLConfig, None, [*base, "algo.prefix_rft.prefixed=3"]))
    assert [float(s.advantages[-1]) for s in samples[:4]] == pytest.approx([0.25, -0.75, 0.25, 0.25])
    with pytest.raises(ConfigError, match="leaves none of the 4"):
        ALGORITHMS.lookup("prefix_rft").objective(load_config(RLConfig, None, [
            *base, "algo.prefix_rft.prefixed=4", "algo.prefix_rft.advantage=code"]))


def test_a_hint_setting_that_would_do_nothing_is_refused():
    with pytest.raises(ConfigError, match="algo.uft.nll_agg=seq-mean-token-sum has no effect: there is no hint NLL"):
        load_config(RLConfig, None, ["algo.name=uft", "algo.uft.nll_coef=0", "algo.uft.nll_agg=seq-mean-token-sum"])
    with pytest.raises(ConfigError, match="clip_prefix=false has no effect: algo.policy_loss=reinforce does not"):
        load_config(RLConfig, None, ["algo.name=prefix_rft", "algo.policy_loss=reinforce",
                                     "algo.prefix_rft.clip_prefix=false"])
