"""Padding-free (packed) forwards against right-padded ones computed the plain Hugging Face
way: the same log-probs, losses and gradients for SFT, the policy loss and the critic, and
two broken packings (attention across sequences, a misplaced boundary) that must differ."""

from __future__ import annotations

import contextlib
import copy
import random
from pathlib import Path

import pytest
import torch

from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.data.batch import Sample
from exactrl.data.encode import SFTExample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.aggregation import AGG_MODES
from exactrl.losses.objective import Metrics
from exactrl.models import packing
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.critic import Critic
from rl_helpers import attach_logprobs, consecutive, policy_micro_batch_loss, sft_micro_batch_loss

PAD = 0


def random_seqs(n: int, seed: int, low: int = 1, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def model(seed=0, **kw):
    m = build_tiny_model(64, PAD, 1, 2, seed=seed, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kw.pop("kv", 4), intermediate_size=64, **kw)
    return m.float()


def padded_reference_logprobs(m, seqs):
    """log p(x[t+1] | x[..t]) from a right-padded batch through plain SDPA, by log_softmax +
    gather (not the cross-entropy path exactrl uses); zero past each sequence's end."""
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("sdpa")
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logp = ref(input_ids=ids, attention_mask=attn).logits.float().log_softmax(-1)[:, :-1]
    out = logp.gather(-1, ids[:, 1:, None])[..., 0]
    valid = torch.tensor([[t < len(s) - 1 for t in range(width - 1)] for s in seqs])
    return torch.where(valid, out, torch.zeros(())), ref


@pytest.mark.parametrize("kv", [4, 2])  # multi-head and grouped-query attention
def test_packed_logprobs_and_gradients_match_padded_reference(kv):
    m = model(kv=kv)
    seqs = random_seqs(9, seed=kv)
    ref_lp, ref = padded_reference_logprobs(m, seqs)
    weights = torch.randn(ref_lp.shape, generator=torch.Generator().manual_seed(1))
    (ref_lp * weights).sum().backward()

    mb = packing.model_batch(m, seqs, PAD, packed=True)
    assert mb.inputs["input_ids"].shape == (1, sum(map(len, seqs)))  # no pad position is computed
    from exactrl.losses.token_losses import token_logprobs

    lp = mb.repad(token_logprobs(m(**mb.inputs).logits, mb.inputs["input_ids"]))
    (lp * weights).sum().backward()
    assert (lp - ref_lp).abs().max().item() < 1e-5
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert (p.grad - q.grad).norm().item() <= 1e-5 * q.grad.norm().item(), name


def sft_examples(seqs):
    rng = random.Random(5)
    out = []
    for s in seqs:
        k = rng.randrange(0, len(s))  # the first k tokens are the prompt
        out.append(SFTExample(input_ids=s, loss_mask=[0] * k + [1] * (len(s) - k), source="test"))
    return out


@pytest.mark.parametrize("agg", AGG_MODES)
def test_sft_loss_and_gradient_packed_equals_padded(agg):
    examples = [e for e in sft_examples(random_seqs(8, seed=3, low=2)) if e.loss_tokens > 0]
    cfg = load_config(SFTConfig, None, [f"train.loss_agg={agg}", "train.global_batch_size=8",
                                        "train.micro_batch_size=8"])
    plan = plan_step([e.loss_tokens for e in examples], len(examples), agg, 32.0, lengths=[len(
        e.input_ids) for e in examples])
    results = {}
    for packed in (False, True):
        m = model(seed=2)
        engine = build_engine(m, cfg, total_steps=1)
        loss, share = sft_micro_batch_loss(m, engine, examples, PAD, plan.normalizer, packed=packed)
        loss.backward()
        results[packed] = (loss.item(), share, torch.cat([p.grad.flatten() for p in m.parameters()]))
    (l0, s0, g0), (l1, s1, g1) = results[False], results[True]
    assert abs(l1 - l0) <= 1e-6 * abs(l0) and s1 == s0
    assert (g1 - g0).norm() <= 1e-5 * g0.norm()


def rl_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(random_seqs(6, seed=seed, low=3, high=12)):
        resp = torch.randint(3, 60, (1 + (i * 5) % 9,), generator=g).tolist()
        adv = torch.tensor([0.0] * (len(s) - 1) + [float(i % 3) - 1.0] * len(resp))
        out.append(Sample(s, resp, reward=0.0, advantages=adv))
    return out


def test_policy_loss_with_kl_and_entropy_packed_equals_padded():
    cfg0 = ["algo.kl_coef=0.1", "algo.entropy_coef=0.01", "train.global_batch_size=6", "train.micro_batch_size=6",
            "algo.group_size=2"]
    results = {}
    for packed in (False, True):
        cfg = load_config(RLConfig, None, [*cfg0, f"train.padding_free={str(packed).lower()}"])
        m, ref = model(seed=4), model(seed=5)
        samples = rl_samples()
        # Old log-probs from a different model, so ratios and clipping are not trivial.
        attach_logprobs(model(seed=6), samples, "old_logprobs", consecutive(6, 3), PAD, 1.0, contextlib.nullcontext,
                        packed)
        attach_logprobs(ref, samples, "ref_logprobs", consecutive(6, 3), PAD, 1.0, contextlib.nullcontext, packed)
        plan = plan_step([len(s.response_ids) for s in samples], 6, cfg.train.loss_agg, 16.0)
        engine = build_engine(m, cfg, total_steps=1)
        loss, _, metrics = policy_micro_batch_loss(m, engine, samples, plan.normalizer, cfg, PAD)
        loss.backward()
        results[packed] = (loss.item(), metrics, torch.cat([p.grad.flatten() for p in m.parameters()]),
                           torch.cat([s.old_logprobs for s in samples]))
    (l0, m0, g0, o0), (l1, m1, g1, o1) = results[False], results[True]
    assert (o1 - o0).abs().max() < 1e-5
    assert abs(l1 - l0) <= 1e-5 * abs(l0) and m0["clip_frac"] > 0
    assert all(abs(m1[k] - m0[k]) <= 1e-5 * max(1.0, abs(m0[k])) for k in m0)
    assert (g1 - g0).norm() <= 1e-5 * g0.norm()


def test_critic_values_and_loss_packed_equals_padded(tmp_path, tokenizer):
    from exactrl.models.loading import load_value_model

    model(seed=7).save_pretrained(tmp_path / "m")
    samples = rl_samples(seed=1)
    for s in samples:
        s.returns = torch.linspace(-1, 1, len(s.advantages))
    results = {}
    for packed in (False, True):
        cfg = load_config(RLConfig, None, ["algo.name=ppo", "algo.group_size=1", "train.global_batch_size=6",
                                           "train.micro_batch_size=3",
                                            f"train.padding_free={str(packed).lower()}",
                                            f"critic.path={tmp_path / 'm'}"])
        critic = Critic(cfg, load_value_model(tmp_path / "m", init_seed=3), total_steps=1, pad_id=PAD)
        for s, values in zip(samples, critic.forward(samples, "values", [consecutive(6, 3)])):
            s.old_values = values
        old = torch.cat([s.old_values for s in samples])
        plan = plan_step([len(s.response_ids) for s in samples], 3, cfg.train.loss_agg, 16.0)
        objective = critic.objective()
        loss, _, _ = critic.micro_batch(samples[:3], objective, dict.fromkeys(objective.groups(), plan.normalizer),
                                        Metrics())
        loss.backward()
        results[packed] = (old, loss.item(), torch.cat([p.grad.flatten() for p in critic.model.parameters()
                                                        if p.grad is not None]))
        for s in samples:
            s.old_values = None
    (v0, l0, g0), (v1, l1, g1) = results[False], results[True]
    assert (v1 - v0).abs().max() < 1e-5 and abs(l1 - l0) <= 1e-5 * abs(l0)
    assert (g1 - g0).norm() <= 1e-5 * g0.norm()


@pytest.mark.parametrize("broken", ["attention across sequences", "a boundary off by one"])
def test_broken_packing_is_detected(broken):
    """The comparison above can fail: packings that leak between sequences give other log-probs."""
    from exactrl.losses.token_losses import token_logprobs

    m = model()
    seqs = random_seqs(6, seed=11, low=5)
    ref_lp, _ = padded_reference_logprobs(m, seqs)
    mb = packing.model_batch(m, seqs, PAD, packed=True)
    inputs = dict(mb.inputs)
    if broken == "attention across sequences":
        m.set_attn_implementation("sdpa")  # one causal sequence over the whole row
    else:  # (rotary positions are relative: not restarting them would change nothing)
        cu = inputs["cu_seq_lens_q"].clone()
        cu[2] += 1
        inputs["cu_seq_lens_q"] = cu
    lp = mb.repad(token_logprobs(m(**inputs).logits, inputs["input_ids"]))
    assert (lp - ref_lp).abs().max().item() > 1e-2


def test_sft_run_padding_free_matches_padded_run(tmp_path, monkeypatch):
    """train.padding_free reaches the training loop: the same run either way ends at the same weights."""
    from safetensors.torch import load_file

    from exactrl.algorithms.sft import train_sft
    from exactrl.tasks.builtin import BuiltinSpec, resolve

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    spec, finals = BuiltinSpec(n_sft=64, n_rl=8, n_eval=8), {}
    for packed in ("false", "true"):
        cfg = load_config(SFTConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                            "train.max_steps=4",
                                            "train.loss_agg=seq-mean-token-mean", "optim.name=sgd", "optim.lr=0.5",
                                            f"train.padding_free={packed}", f"output_dir={tmp_path / packed}"])
        finals[packed] = load_file(train_sft(cfg, spec=spec).final_model / "model.safetensors")
    initial = load_file(Path(resolve(cfg.model.path, "model", spec)) / "model.safetensors")
    padded = finals["false"]
    for k, w in finals["true"].items():
        step = (padded[k] - initial[k]).norm()
        assert step > 0 and (w - padded[k]).norm() <= 1e-5 * step, k
