"""Every advantage estimator against values computed by hand or by a plain loop written here,
independently of the vectorised code in exactrl/advantages/."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.advantages import ADVANTAGES, AdvantageInput, get_advantage

# Two prompts x two responses; response lengths 3, 1, 2, 3 after a one-token prompt column.
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float64)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)


def per_response(adv):
    """The one value an outcome estimator puts on every token of a response (checks it is constant)."""
    out = []
    for row, m in zip(adv, MASK):
        vals = row[m > 0]
        assert torch.all(vals == vals[0]) and torch.all(row[m == 0] == 0)
        out.append(float(vals[0]))
    return out


def test_grpo_by_hand():
    adv, _ = get_advantage("grpo")(AdvantageInput(REWARDS, MASK, group_size=2))
    s1, s2 = math.sqrt(0.5), math.sqrt(2 * 0.125**2)  # unbiased std of (1, 0) and (0.5, 0.25)
    expected = [0.5 / (s1 + 1e-6), -0.5 / (s1 + 1e-6), 0.125 / (s2 + 1e-6), -0.125 / (s2 + 1e-6)]
    assert per_response(adv) == pytest.approx(expected, rel=1e-12)


def test_dr_grpo_only_centres():
    adv, _ = get_advantage("dr_grpo")(AdvantageInput(REWARDS, MASK, group_size=2))
    assert per_response(adv) == pytest.approx([0.5, -0.5, 0.125, -0.125], rel=1e-12)


def test_rloo_subtracts_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 1.0], dtype=torch.float64)
    mask = torch.ones(6, 2, dtype=torch.float64)
    adv, _ = get_advantage("rloo")(AdvantageInput(rewards, mask, group_size=3))
    expected = []
    for g in range(2):
        group = rewards[3 * g : 3 * g + 3].tolist()
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            expected.append(r - sum(others) / len(others))
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage("rloo")(AdvantageInput(rewards, mask, group_size=1))


def loop_returns(rewards, mask, token_rewards, gamma):
    """Return to go, one response at a time, the way it is written on paper."""
    out = torch.zeros_like(mask)
    for i in range(mask.size(0)):
        positions = [t for t in range(mask.size(1)) if mask[i, t] > 0]
        r = {t: float(token_rewards[i, t]) for t in positions}
        r[positions[-1]] += float(rewards[i])
        for t in positions:
            out[i, t] = sum(gamma ** (k - positions.index(t)) * r[s] for k, s in enumerate(positions) if s >= t)
    return out


def loop_whiten(values, mask):
    xs = [float(values[i, t]) for i in range(mask.size(0)) for t in range(mask.size(1)) if mask[i, t] > 0]
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return (values - mean) / (std + 1e-6) * mask


KL = torch.tensor([[0, -0.1, -0.2, -0.05], [0, -0.3, 0, 0], [0, 0.1, -0.1, 0], [0, -0.2, -0.2, -0.2]],
                  dtype=torch.float64)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_is_the_whitened_return_to_go(gamma):
    adv, returns = get_advantage("reinforce_pp")(AdvantageInput(REWARDS, MASK, token_rewards=KL, gamma=gamma))
    expected_returns = loop_returns(REWARDS, MASK, KL, gamma)
    assert torch.allclose(returns, expected_returns, rtol=1e-12, atol=1e-12)
    assert torch.allclose(adv, loop_whiten(expected_returns, MASK), rtol=1e-10, atol=1e-12)
    # whitened over the batch's tokens: mean 0, std 1
    vals = adv[MASK > 0]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-12) and float(vals.std()) == pytest.approx(1.0, rel=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    adv, returns = get_advantage("reinforce_pp_baseline")(AdvantageInput(REWARDS, MASK, group_size=2, token_rewards=KL))
    baselined = torch.tensor([0.5, -0.5, 0.125, -0.125], dtype=torch.float64)
    expected_returns = loop_returns(baselined, MASK, KL, 1.0)
    assert torch.allclose(returns, expected_returns, rtol=1e-12, atol=1e-12)
    assert torch.allclose(adv, loop_whiten(expected_returns, MASK), rtol=1e-10, atol=1e-12)


def test_gae_by_hand_on_one_response():
    # Three response tokens, values 0.5, 0.4, 0.2, outcome reward 1 on the last token, gamma 0.9, lambda 0.8.
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.float64)
    values = torch.tensor([[9.0, 0.5, 0.4, 0.2]], dtype=torch.float64)  # the prompt position's value is ignored
    g, lam = 0.9, 0.8
    d2 = 1.0 + g * 0.0 - 0.2
    d1 = 0.0 + g * 0.2 - 0.4
    d0 = 0.0 + g * 0.4 - 0.5
    a2, a1 = d2, d1 + g * lam * d2
    a0 = d0 + g * lam * a1
    adv, returns = get_advantage("gae")(AdvantageInput(torch.tensor([1.0], dtype=torch.float64), mask, values=values,
                                                       gamma=g, lam=lam))
    assert adv[0].tolist() == pytest.approx([0.0, a0, a1, a2], rel=1e-12)
    assert returns[0].tolist() == pytest.approx([0.0, a0 + 0.5, a1 + 0.4, a2 + 0.2], rel=1e-12)


def test_gae_with_lambda_1_and_gamma_1_is_return_minus_value():
    values = torch.rand(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    adv, _ = get_advantage("gae")(AdvantageInput(REWARDS, MASK, values=values, token_rewards=KL))
    assert torch.allclose(adv, (loop_returns(REWARDS, MASK, KL, 1.0) - values) * MASK, rtol=1e-12, atol=1e-12)


def test_registry_names_and_errors():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; choose one of dr_grpo, gae"):
        get_advantage("ppo")
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        get_advantage("gae")(AdvantageInput(REWARDS, MASK))
    with pytest.raises(ValueError, match="do not form whole groups of 3"):
        get_advantage("grpo")(AdvantageInput(REWARDS, MASK, group_size=3))


def verl_grpo_with_kl_in_reward(scores, kl, mask, group_size, std_normalize, eps=1e-6):
    """verl's path written out (trainer/ppo/ray_trainer.py apply_kl_penalty, then core_algos.py
    compute_grpo_outcome_advantage): token_level_rewards = scores on the last response token -
    beta KL per response token; each response's score is their sum; (score - group mean) / (group
    std + eps), one Python loop per group."""
    token_level = -kl * mask
    for i in range(mask.size(0)):
        last = max(t for t in range(mask.size(1)) if mask[i, t] > 0)
        token_level[i, last] += scores[i]
    summed = token_level.sum(-1).tolist()
    out = []
    for g in range(0, len(summed), group_size):
        group = summed[g : g + group_size]
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        out += [(x - mean) / (std + eps) if std_normalize else x - mean for x in group]
    return out


@pytest.mark.parametrize("name,std_normalize", [("grpo", True), ("grpo", False), ("dr_grpo", False)])
def test_group_estimators_take_the_kl_in_the_reward_as_verl_does(name, std_normalize):
    """Before: the group estimators (and the methods built on grpo's) ignored token_rewards, so
    algo.kl_in_reward=true trained with no KL penalty at all."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 6, generator=g, dtype=torch.float64) < 0.8).double()
    mask[:, 0] = 0  # a prompt target
    mask[:, 1] = 1  # every response has a token
    scores, kl = torch.rand(8, generator=g, dtype=torch.float64), torch.rand(
        8, 6, generator=g, dtype=torch.float64) - 0.3
    # the KL sits on prompt targets too (the log-probs cover the whole sequence): only response tokens may count
    adv, _ = get_advantage(name)(AdvantageInput(scores, mask, 4, token_rewards=-kl, std_normalize=std_normalize))
    ref = verl_grpo_with_kl_in_reward(scores, kl, mask, 4, std_normalize)
    for row, m, want in zip(adv, mask, ref):
        assert row[m > 0].tolist() == pytest.approx([want] * int(m.sum()), rel=1e-12, abs=1e-12)
    assert adv[mask == 0].abs().max() == 0


def test_rloo_takes_the_kl_in_the_reward_in_each_score():
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(6, 3, dtype=torch.float64)
    scores, kl = torch.rand(6, generator=g, dtype=torch.float64), torch.rand(6, 3, generator=g, dtype=torch.float64)
    adv, _ = get_advantage("rloo")(AdvantageInput(scores, mask, 3, token_rewards=-kl))
    total = (scores - kl.sum(1)).tolist()
    expected = [total[i] - sum(total[j] for j in range(3 * (i // 3), 3 * (i // 3) + 3) if j != i) / 2 for i in range(6)]
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-12)


def test_every_estimator_declares_and_reads_the_kl_in_the_reward():
    from exactrl.advantages.estimators import TOKEN_REWARDS

    # "none" (on-policy distillation: no advantages) reads no reward, so it does not declare one: rl.py refuses
    # algo.kl_in_reward for it
    assert set(TOKEN_REWARDS) == set(ADVANTAGES) - {"none"}
    g = torch.Generator().manual_seed(2)
    mask, rewards = torch.ones(4, 3, dtype=torch.float64), torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    values = torch.rand(4, 3, generator=g, dtype=torch.float64)
    assert not get_advantage("none")(AdvantageInput(rewards, mask, 4, token_rewards=-values))[0].any()
    for name in TOKEN_REWARDS:
        # one group of 4: a pair's z-scores are +-0.71 whatever the scores
        plain, _ = get_advantage(name)(AdvantageInput(rewards, mask, 4, values=values))
        kl = torch.rand(4, 3, generator=g, dtype=torch.float64)
        with_kl, _ = get_advantage(name)(AdvantageInput(rewards, mask, 4, token_rewards=-kl, values=values))
        assert (with_kl - plain).abs().max() > 1e-3, name
