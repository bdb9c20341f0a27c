"""PPO's pieces: the value model loaded from a causal LM (a deterministic new head on the
same trunk) and from a saved critic (its head kept), GAE advantages and the critic's returns
through attach_advantages against a hand computation, reward whitening / scaling, and every
policy and value loss on the one-process engine against the one-pass references of
tests/dist/rl_equivalence.py (the same cases run on FSDP2 and DeepSpeed in
tests/test_rl_backends.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from exactrl.algorithms.rl import attach_advantages
from exactrl.config import RLConfig, load_config
from exactrl.data.batch import Sample
from exactrl.models.loading import load_value_model
from exactrl.tasks.tiny_model import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent / "dist"))
import rl_equivalence as R

from distributed_harness import TOL


def test_value_model_new_head_is_deterministic_and_a_saved_critic_keeps_its_head(tmp_path, tokenizer, small_overrides):
    save_tiny_model(tmp_path / "lm", tokenizer, seed=4, **small_overrides)
    a, b = load_value_model(tmp_path / "lm", init_seed=7), load_value_model(tmp_path / "lm", init_seed=7)
    other = load_value_model(tmp_path / "lm", init_seed=8)
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(a.score.weight, other.score.weight)
    hidden = a.score.weight.shape[1]
    assert abs(float(a.score.weight.std()) * (hidden + 1) - 1) < 0.5 and float(a.score.bias.abs().max()) == 0.0
    from safetensors.torch import load_file

    lm = load_file(tmp_path / "lm" / "model.safetensors")
    assert all(torch.equal(v, lm[f"model.{k}"]) for k, v in a.model.state_dict().items())  # the policy's trunk
    assert a.training and all(not isinstance(m, torch.nn.Dropout) or m.p == 0 for m in a.modules())
    with torch.no_grad():
        a.score.weight.add_(1.0)
    a.save_pretrained(tmp_path / "critic")
    again = load_value_model(tmp_path / "critic", init_seed=7)
    assert torch.equal(again.score.weight, a.score.weight)


def gae_by_hand(rewards, values, gamma, lam):
    """A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t, V after the end = 0."""
    n, adv, nxt = len(values), [0.0] * len(values), 0.0
    for t in reversed(range(n)):
        v_next = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * v_next - values[t]
        nxt = delta + gamma * lam * nxt
        adv[t] = nxt
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("reward_norm", ["none", "whiten", "scale"])
def test_gae_advantages_and_returns_by_hand(tokenizer, whiten, reward_norm):
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        prompt, resp = tokenizer(f"{i}+1=")["input_ids"], list(range(7, 9 + i))
        n = len(prompt) + len(resp) - 1
        samples.append(Sample(prompt, resp, reward=float(i % 3), old_values=torch.randn(n, generator=g),
                              old_logprobs=-torch.rand(n, generator=g), ref_logprobs=-torch.rand(n, generator=g)))
    cfg = load_config(RLConfig, None, ["algo.name=ppo", "algo.group_size=1", "train.global_batch_size=6",
                                       "train.micro_batch_size=3",
                                        "algo.gamma=0.9", "algo.gae.lam=0.8", "algo.kl_coef=0.1",
                                        "algo.kl_in_reward=true",
                                        f"algo.gae.whiten_advantages={whiten}", f"algo.reward_norm={reward_norm}"])
    attach_advantages(samples, cfg)
    outcome = [s.reward for s in samples]
    mean = sum(outcome) / len(outcome)
    std = (sum((r - mean) ** 2 for r in outcome) / (len(outcome) - 1)) ** 0.5
    outcome = {"none": outcome, "whiten": [(r - mean) / (std + 1e-6) for r in outcome], "scale": [r / (
        std + 1e-6) for r in outcome]}[reward_norm]
    expected, flat = [], []
    for s, r_out in zip(samples, outcome):
        start = len(s.prompt_ids) - 1
        idx = range(start, start + len(s.response_ids))
        r = [-0.1 * float(s.old_logprobs[t] - s.ref_logprobs[t]) for t in idx]
        r[-1] += r_out
        adv, ret = gae_by_hand(r, [float(s.old_values[t]) for t in idx], 0.9, 0.8)
        expected.append((adv, ret))
        flat += adv
    m = sum(flat) / len(flat)
    sd = (sum((x - m) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    for s, (adv, ret) in zip(samples, expected):
        start = len(s.prompt_ids) - 1
        want = [(a - m) / (sd + 1e-6) for a in adv] if whiten else adv
        assert torch.all(s.advantages[:start] == 0) and torch.all(s.returns[:start] == 0)
        assert s.advantages[start:].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert s.returns[start:].tolist() == pytest.approx(ret, rel=1e-5, abs=1e-5)  # returns are never whitened


@pytest.mark.parametrize("case", R.POLICY_CASES + R.VALUE_CASES, ids=lambda c: f"{c['loss']}-{c['mode']}")
@pytest.mark.parametrize("micro", [1, 2, 8])
def test_every_rl_loss_on_the_single_engine_matches_the_one_pass_reference(tokenizer, case, micro):
    samples = R.make_rollout(tokenizer)
    rollout = R.sequence_advantages(samples) if case["loss"] == "gspo" else samples
    layout = ["distributed.backend=single"]
    got = R.exactrl_run(dict(case, micro=micro), rollout, tokenizer, layout)
    cfg = R.case_config(dict(case, micro=micro), layout)
    ref, init = R.reference(case, rollout, tokenizer, R.dtype_of(cfg))
    den = sum(((ref[k] - init[k]).norm() ** 2).item() for k in ref)
    assert den > 1e-4 and R.relative_error(got, ref, init) <= TOL[R.precision(cfg)]
