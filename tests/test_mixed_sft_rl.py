"""CHORD, HPT and ReLIFT (exactrl/algorithms/sft_rl.py, exactrl/rollout/gated.py): each loss
against a closed-form value and gradient written from its paper's formula with plain torch, and
each step's applied update against one full-batch pass, for micro-batches holding different
shares of demonstration and on-policy tokens."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.rl import attach_advantages
from exactrl.algorithms.sft_rl import SFT_OBJECTIVE, SFTBuffer, sft_step_plan
from exactrl.config import ConfigError, RLConfig, SFTConfig, load_config
from exactrl.data.batch import Sample, collate
from exactrl.data.encode import Prompt
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Metrics, micro_batch_loss
from exactrl.rollout import gated
from exactrl.workers.worker import Worker

CLIP = 0.2


def chord_config(*extra: str) -> RLConfig:
    return load_config(RLConfig, None, ["algo.name=chord", "algo.group_size=2", "train.global_batch_size=4",
                                        "train.micro_batch_size=2", "algo.chord.mu_warmup=4", "algo.chord.mu_decay=10",
                                        "algo.chord.mu_peak=0.8", "algo.chord.mu_valley=0.1", *extra])


def paper_mu(step: int, warmup=4, decay=10, peak=0.8, valley=0.1) -> float:
    """CHORD's mu (arXiv 2508.11408): linear warm-up to the peak, then cosine decay to the valley, then held."""
    if step < warmup:
        return peak * step / warmup
    if step >= warmup + decay:
        return valley
    return valley + (peak - valley) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / decay))


def hand_made() -> tuple[list[Sample], torch.Tensor]:
    """Two on-policy responses (3 and 5 tokens) and two demonstrations (4 and 2 tokens) after a
    2-token prompt, with log-probs whose ratios to the old ones fall inside and outside the clip."""
    g = torch.Generator().manual_seed(0)
    lengths, sources = [3, 5, 4, 2], ["on_policy", "on_policy", "demonstration", "demonstration"]
    samples = []
    for n, src, adv in zip(lengths, sources, [1.5, -0.7, 0.0, 0.0]):
        t = n + 1
        on = src == "on_policy"
        old = -torch.rand(t, generator=g) * 2 if on else torch.zeros(t)
        samples.append(Sample([1, 2], list(range(5, 5 + n)), source=src, advantages=torch.full((t,), adv),
                              old_logprobs=old))
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 2 - 0.05
    for s, row in zip(samples[:2], logp):  # ratios exp(logp - old) of 0.7-1.4: some clipped, some not
        row[: s.num_targets] = s.old_logprobs.double() + torch.tensor([0.3, -0.05, 0.1, -0.4, 0.02, 0.25][
            : s.num_targets], dtype=torch.float64)
    return samples, logp.requires_grad_()


def masks(samples):
    b = collate(samples, 0)
    on = b["loss_mask"].double() * torch.tensor([s.source == "on_policy" for s in samples])[:, None]
    return b, on, b["loss_mask"].double() - on


def mixed_loss(objective, samples, logp, micro: int = 4, plan=None):
    """The step loss as the worker adds it up: every micro-batch of the plan under the step's normalisers."""
    plan = plan or plan_samples(samples, micro, "token-mean")
    normalizers, total, shares = objective.normalizers(plan), 0.0, 0.0
    for mb in plan.micro_batches:
        chunk = [samples[i] for i in mb]
        b = collate(chunk, 0)
        f = {"logprobs": logp[list(mb), : b["loss_mask"].size(1)]}
        part, share = micro_batch_loss(objective, f, b, b, [s.source for s in chunk], normalizers, Metrics(),
                                       plan.mean_of())
        total, shares = total + part, shares + share
    return total, shares


@pytest.mark.parametrize("step", [2, 7, 30])
@pytest.mark.parametrize("phi", [False, True])
def test_chord_is_one_minus_mu_grpo_plus_mu_sft_in_value_and_gradient(step, phi):
    """(1 - mu) x the clipped surrogate's token mean over on-policy tokens + mu x the NLL's token
    mean over demonstration tokens (x sg(p (1 - p)) with phi), mu at the step in warm-up, cosine,
    held. Gradient in closed form: -(1 - mu) r A / N_on where the unclipped branch is the min,
    0 where the clip holds; -mu w / N_demo on demonstration tokens."""
    samples, logp = hand_made()
    objective = ALGORITHMS.lookup("chord").objective(chord_config(f"algo.chord.phi={str(phi).lower()}")).at(step)
    loss, share = mixed_loss(objective, samples, logp, micro=2)
    loss.backward()

    b, on, demo = masks(samples)
    lp, old, adv = logp.detach()[:, :6], b["old_logprobs"].double(), b["advantages"].double()
    r = torch.exp(lp - old)
    unclipped, clipped = r * adv, r.clamp(1 - CLIP, 1 + CLIP) * adv
    p = lp.exp()
    w = p * (1 - p) if phi else torch.ones_like(p)
    mu = paper_mu(step)
    value = (1 - mu) * (-torch.minimum(unclipped, clipped) * on).sum() / on.sum() + mu * (-lp * w * demo).sum() / \
        demo.sum()
    active = (unclipped <= clipped).double()
    grad = (1 - mu) * (-r * adv * active * on) / on.sum() + mu * (-w * demo) / demo.sum()
    assert 0 < (active * on).sum() < on.sum()  # both branches of the clip are exercised
    assert share == pytest.approx(1.0, abs=1e-12)
    assert loss.item() == pytest.approx(value.item(), rel=1e-12)
    assert torch.allclose(logp.grad[:, :6], grad, rtol=1e-10, atol=1e-14)
    assert logp.grad[:, 6:].abs().sum() == 0  # padding


def group(rewards: list[float], prompt: int) -> list[Sample]:
    return [Sample([1, prompt], [5 + k] * (2 + k), r, parts={"acc": r}) for k, r in enumerate(rewards)]


def test_hpt_gate_sends_questions_with_few_correct_responses_to_sft(monkeypatch):
    """Correct counts 0, 1, 3 of 4 per question: gate 0 sends the first to SFT, gate 1 the first
    two, gate 3 all; the rest keep their GRPO groups; sft_share says how many were sent."""
    rollout = group([0, 0, 0, 0], 3) + group([0, 1, 0, 0], 4) + group([1, 1, 0, 1], 5)
    prompts = [Prompt([1, k], f"q{k}", "a", f"f:{k}", demonstration=[7] * k) for k in range(6)]
    monkeypatch.setattr(gated, "collect_rollout", lambda *a, **k: (list(rollout), {"accuracy": 4 / 12}))
    for gate, sent in ((0, [3]), (1, [3, 4]), (3, [3, 4, 5])):
        cfg = load_config(RLConfig, None, ["algo.name=hpt", "algo.group_size=4", f"algo.hpt.gate={gate}"])
        samples, stats = gated.gated(None, prompts, [3, 4, 5], 0, None, cfg)
        kept = [s for s in samples if s.source == "on_policy"]
        demos = [s for s in samples if s.source == "demonstration"]
        assert [d.prompt_ids[1] for d in demos] == sent and all(d.response_ids == [7] * d.prompt_ids[1] for d in demos)
        assert {s.prompt_ids[1] for s in kept} == {3, 4, 5} - set(sent) and len(kept) == 4 * (3 - len(sent))
        assert stats["sft_share"] == pytest.approx(len(sent) / 3)


def test_hpt_loss_is_grpo_on_kept_questions_plus_sft_on_the_others(monkeypatch):
    """Gate 1 over correct counts 0, 1, 3: the third question's group under GRPO without std
    (A = r - group mean, Unify-Post-Training's grpo_use_std=False), the first two's
    demonstrations under sft_coef x NLL, each a token mean over its own tokens of the step."""
    rollout = group([0, 0, 0, 0], 3) + group([0, 1, 0, 0], 4) + group([1, 1, 0, 1], 5)
    prompts = [Prompt([1, k], f"q{k}", "a", f"f:{k}", demonstration=[7] * k) for k in range(6)]
    monkeypatch.setattr(gated, "collect_rollout", lambda *a, **k: (list(rollout), {}))
    cfg = load_config(RLConfig, None, ["algo.name=hpt", "algo.group_size=4", "algo.hpt.gate=1", "algo.hpt.sft_coef=0.3",
                                       "algo.std_normalize=false", "train.global_batch_size=4",
                                       "train.micro_batch_size=2"])
    samples, _ = gated.gated(None, prompts, [3, 4, 5], 0, None, cfg)
    attach_advantages(samples, cfg)
    g = torch.Generator().manual_seed(1)
    for s in samples:
        s.old_logprobs = -torch.rand(s.num_targets, generator=g)
    width = max(s.num_targets for s in samples)
    logp = (torch.stack([torch.nn.functional.pad(s.old_logprobs, (0, width - s.num_targets)) for s in samples])
            .double().requires_grad_())
    objective = ALGORITHMS.lookup("hpt").objective(cfg)
    loss, share = mixed_loss(objective, samples, logp, micro=3)
    loss.backward()

    _, on, demo = masks(samples)
    rewards = torch.tensor([1.0, 1, 0, 1])
    adv = torch.zeros(len(samples), width, dtype=torch.float64)
    adv[:4] = (rewards - rewards.mean())[:, None]
    value = (-adv * on).sum() / on.sum() + 0.3 * (-logp.detach() * demo).sum() / demo.sum()  # ratio 1 at the rollout
    grad = -adv * on / on.sum() - 0.3 * demo / demo.sum()
    assert share == pytest.approx(1.0, abs=1e-12) and loss.item() == pytest.approx(value.item(), rel=1e-12)
    assert torch.allclose(logp.grad, grad, rtol=1e-10, atol=1e-14)


def test_relift_buffers_unsolved_questions_newest_first_and_releases_a_full_batch():
    """Only questions no response solved are buffered; the newest ``size`` are released once the
    buffer holds that many, the rest wait for the next release (ReLIFT's trainer.py)."""
    buffer = SFTBuffer(3)
    assert buffer.push(group([0, 0], 1) + group([1, 0], 1) + group([0, 0], 1), [10, 11, 12], 2) == 2
    assert buffer.pending == [10, 12] and buffer.release() is None
    assert buffer.push(group([0, 0], 1) + group([0, 0], 1), [13, 14], 2) == 2
    assert buffer.pending == [13, 14, 10, 12]
    assert buffer.release() == [13, 14, 10] and buffer.pending == [12]
    assert buffer.release() is None


def demonstrations(lengths: list[int]) -> list[Sample]:
    return [Sample([1, 2], list(range(5, 5 + n)), source="demonstration") for n in lengths]


@pytest.mark.parametrize("world,sizes", [(1, [2, 2, 1]), (2, [2, 1, 1, 1])])
@pytest.mark.parametrize("mean_of_means", [False, True])
def test_relift_sft_step_under_both_normalisers(mean_of_means, world, sizes):
    """Five demonstrations of 1-7 tokens in micro-batches of at most 2 (over 2 ranks: 4 of them,
    2 per rank): the default is the step's one token mean (grad -1/N per token); mean_of_means is
    the mean over every rank's micro-batches of each one's token mean (grad -1/(K N_k)); they differ."""
    samples = demonstrations([1, 7, 2, 6, 3])
    plan = sft_step_plan(samples, 2, world, mean_of_means)
    assert [len(mb) for mb in plan.micro_batches] == sizes
    logp = (-torch.rand(5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)).requires_grad_()
    loss, share = mixed_loss(SFT_OBJECTIVE, samples, logp, plan=plan)
    loss.backward()

    mask = collate(samples, 0)["loss_mask"].double()
    lp = logp.detach()
    full = (-lp * mask).sum() / mask.sum()
    means = [(-lp[list(mb)] * mask[list(mb)]).sum() / mask[list(mb)].sum() for mb in plan.micro_batches]
    grad = -mask / mask.sum()
    if mean_of_means:
        grad = torch.zeros_like(mask)
        for mb in plan.micro_batches:
            grad[list(mb)] = -mask[list(mb)] / (len(plan.micro_batches) * mask[list(mb)].sum())
    value = torch.stack(means).mean() if mean_of_means else full
    assert share == pytest.approx(1.0, abs=1e-12) and loss.item() == pytest.approx(value.item(), rel=1e-12)
    assert torch.allclose(logp.grad, grad, rtol=1e-10, atol=1e-14)
    assert abs(torch.stack(means).mean().item() - full.item()) > 1e-2  # uneven micro-batches: the two differ


def sgd_worker(model, tokenizer):
    cfg = load_config(SFTConfig, None, ["optim.name=sgd", "optim.lr=1.0", "optim.scheduler=constant",
                                        "train.max_grad_norm=0"])
    return Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tokenizer.pad_token_id)


def mixed_rollout(tokenizer) -> list[Sample]:
    """Three groups of two on-policy responses, then two demonstrations (one long, one short): a
    plan of small micro-batches gives them different shares of both kinds of token."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for k, n in enumerate([3, 6, 2, 5, 4, 1]):
        ids = [tokenizer.bos_token_id, 20 + k // 2]
        samples.append(Sample(ids, [30 + (k * j) % 9 for j in range(n)], advantages=torch.full((n + 1,), (-1.0) ** k *
                                                                                              (0.5 + k / 4))))
    samples += [Sample([tokenizer.bos_token_id, 21], [40 + j % 7 for j in range(n)], source="demonstration",
                       advantages=torch.zeros(n + 1)) for n in (9, 2)]
    for s in samples:
        s.old_logprobs = -torch.rand(s.num_targets, generator=g) * 0.1 - 3.0
    return samples


def one_pass(model, samples, pad_id, mu, phi):
    """CHORD's step loss in one pass over the padded batch, from the paper's formula."""
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [pad_id] * (width - len(s.ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    b = collate(samples, pad_id)
    on = b["loss_mask"].float() * torch.tensor([s.source == "on_policy" for s in samples])[:, None]
    demo = b["loss_mask"].float() - on
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1).gather(
        -1, ids[:, 1:, None])[..., 0]
    r = torch.exp(logp - b["old_logprobs"])
    adv = b["advantages"]
    surrogate = -torch.minimum(r * adv, r.clamp(1 - CLIP, 1 + CLIP) * adv)
    p = logp.detach().exp()
    w = p * (1 - p) if phi else 1.0
    return (1 - mu) * (surrogate * on).sum() / on.sum() + mu * (-logp * w * demo).sum() / demo.sum()


@pytest.mark.parametrize("micro", [1, 3, 8])
def test_a_chord_step_applies_the_full_batch_update_for_any_micro_batches(tokenizer, make_model, micro):
    """The worker's step over micro-batches holding different shares of demonstration and
    on-policy tokens applies exactly the one-pass gradient of CHORD's loss (phi on, mu in warm-up)."""
    samples = mixed_rollout(tokenizer)
    cfg = chord_config("algo.chord.phi=true")
    ref = make_model(5)
    loss = one_pass(ref, samples, tokenizer.pad_token_id, paper_mu(0), phi=True)
    loss.backward()
    model = make_model(5)
    before = [p.detach().clone() for p in model.parameters()]
    result = sgd_worker(model, tokenizer).train_step(samples, plan_samples(samples, micro, "token-mean", sort=True),
                                                     ALGORITHMS.lookup("chord").objective(cfg))
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6) and result.loss == pytest.approx(loss.item(),
                                                                                                   rel=1e-5)
    for p, q, p0 in zip(model.parameters(), ref.parameters(), before):
        assert torch.allclose(p0 - p.detach(), q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mean_of_means", [False, True])
def test_a_relift_sft_step_applies_its_normalisers_update(tokenizer, make_model, mean_of_means):
    """ReLIFT's SFT step on demonstrations of 2-9 tokens in micro-batches of at most 2: by default
    the applied update is the full-batch token mean's gradient; with mean_of_means, the gradient
    of the mean of the micro-batches' token means, which is not the full-batch one."""
    samples = demonstrations([9, 2, 3, 8, 2])
    plan = sft_step_plan(samples, 2, 1, mean_of_means)
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [tokenizer.pad_token_id] * (width - len(s.ids)) for s in samples])
    mask = collate(samples, tokenizer.pad_token_id)["loss_mask"].float()
    grads = {}
    for kind in ("full", "means"):
        ref = make_model(6)
        nll = -torch.log_softmax(ref(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits[
            :, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = (nll * mask).sum() / mask.sum() if kind == "full" else torch.stack(
            [(nll[list(mb)] * mask[list(mb)]).sum() / mask[list(mb)].sum() for mb in plan.micro_batches]).mean()
        loss.backward()
        grads[kind] = [q.grad for q in ref.parameters()]
    model = make_model(6)
    before = [p.detach().clone() for p in model.parameters()]
    result = sgd_worker(model, tokenizer).train_step(samples, plan, SFT_OBJECTIVE)
    applied = [p0 - p.detach() for p, p0 in zip(model.parameters(), before)]
    want, other = (grads["means"], grads["full"]) if mean_of_means else (grads["full"], grads["means"])
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)
    assert all(torch.allclose(a, g, rtol=1e-5, atol=1e-7) for a, g in zip(applied, want))
    assert not all(torch.allclose(a, g, rtol=1e-3, atol=1e-5) for a, g in zip(applied, other))


@pytest.mark.parametrize("overrides,message", [
    (["algo.hpt.gate=2"], "algo.hpt.gate=2 has no effect: algo.hpt.* is hpt's (algo.name=grpo); set algo.name=hpt"),
    (["algo.name=hpt", "algo.relift.mean_of_means=true"], "algo.relift.mean_of_means=true has no effect"),
    (["algo.name=chord", "algo.mini_batches=2"], "algo.name=chord trains each rollout's responses and its prompts' "
                                                 "demonstrations in one optimizer step: set algo.ppo_epochs=1"),
    (["algo.name=relift", "algo.relift.buffer_size=1", "distributed.nproc_per_node=2", "distributed.backend=fsdp2",
      "train.global_batch_size=16", "train.micro_batch_size=4"],
     "algo.relift.buffer_size=1 is smaller than the 2 ranks an SFT step spreads its demonstrations over"),
])
def test_settings_the_mixed_methods_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, overrides)
    assert message in str(e.value)
