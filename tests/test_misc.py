"""Small numerical pieces: the Wilson interval, GRPO advantages and the learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from exactrl.advantages import group_advantages
from exactrl.config.schema import OptimConfig
from exactrl.distributed.optim import build_optimizer, build_scheduler, lr_factor
from exactrl.run.evaluation import wilson_interval

Z = 1.959964

# ---------------------------------------------------------------- Wilson interval


def wilson_by_quadratic(k: int, n: int, z: float = Z) -> tuple[float, float]:
    """The interval's ends are the p solving (k/n - p)^2 = z^2 p (1 - p) / n, i.e.
    (1 + z^2/n) p^2 - (2 k/n + z^2/n) p + (k/n)^2 = 0."""
    ph = k / n
    a, b, c = 1 + z * z / n, -(2 * ph + z * z / n), ph * ph
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize("k,n,expected", [
    (0, 10, (0.0, 0.2775)),
    (5, 10, (0.2366, 0.7634)),
    (10, 10, (0.7225, 1.0)),
    (81, 263, (0.2553, 0.3662)),  # Newcombe (1998), Statistics in Medicine 17:857, example
])
def test_wilson_textbook_values(k, n, expected):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(expected[0], abs=5e-5) and hi == pytest.approx(expected[1], abs=5e-5)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (1, 7), (3, 7), (6, 7), (0, 500), (1, 500), (250, 500), (499, 500),
                                 (37, 2000)])
def test_wilson_matches_quadratic_roots(k, n):
    lo, hi = wilson_interval(k, n)
    ref_lo, ref_hi = wilson_by_quadratic(k, n)
    assert lo == pytest.approx(max(0.0, ref_lo), rel=1e-9, abs=1e-12)
    assert hi == pytest.approx(min(1.0, ref_hi), rel=1e-9, abs=1e-12)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0, 37)[0] == 0.0 and wilson_interval(37, 37)[1] == 1.0
    # A wider z gives a wider interval.
    assert wilson_interval(3, 10, z=2.576)[0] < wilson_interval(3, 10)[0]


# ---------------------------------------------------------------- GRPO advantages


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    eps = 1e-6
    # Group 0: mean 0.5, unbiased std sqrt((4 x 0.25) / 3) = sqrt(1/3).
    s0 = math.sqrt(1 / 3)
    # Group 1: mean 0.75, unbiased std sqrt((3 x 0.0625 + 0.5625) / 3) = 0.5.
    s1 = 0.5
    expected = [0.5 / (s0 + eps), -0.5 / (s0 + eps), -0.5 / (s0 + eps), 0.5 / (s0 + eps),
                0.25 / (s1 + eps), 0.25 / (s1 + eps), 0.25 / (s1 + eps), -0.75 / (s1 + eps)]
    got = group_advantages(rewards, group_size=4, eps=eps)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=0)


def test_group_advantages_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    got = group_advantages(rewards, group_size=4, std_normalize=False)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_group_advantages_equal_rewards_and_group_order():
    got = group_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), group_size=2)
    assert got[:2].tolist() == [0.0, 0.0]  # a group with one reward has no signal, and no NaN
    s = math.sqrt(2.0)  # unbiased std of [0, 2]
    torch.testing.assert_close(got[2:], torch.tensor([-1 / (s + 1e-6), 1 / (s + 1e-6)]), rtol=1e-6, atol=0)


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="whole groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


# ---------------------------------------------------------------- learning-rate schedule


def cfg(**kw) -> OptimConfig:
    return OptimConfig(name="sgd", lr=0.1, **kw)


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
def test_warmup_is_linear_up_to_one(scheduler):
    c = cfg(scheduler=scheduler, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_factor(s, c, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, c, 100) == 1.0  # decay starts from the peak


def test_cosine_and_linear_endpoints_and_midpoints():
    # warm-up 10 of 110 steps: the decay runs over steps 10..110.
    cos, lin = cfg(scheduler="cosine", warmup_steps=10, min_lr_ratio=0.1), cfg(
        scheduler="linear", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(10, cos, 110) == 1.0 and lr_factor(10, lin, 110) == 1.0
    assert lr_factor(60, cos, 110) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)  # half way: cos(pi/2) = 0
    assert lr_factor(60, lin, 110) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)
    assert lr_factor(35, cos, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-12)
    assert lr_factor(35, lin, 110) == pytest.approx(0.1 + 0.9 * 0.75, rel=1e-12)
    for c in (cos, lin):
        assert lr_factor(110, c, 110) == pytest.approx(0.1, rel=1e-12)
        assert lr_factor(500, c, 110) == pytest.approx(0.1, rel=1e-12)  # clamped past the end
        values = [lr_factor(s, c, 110) for s in range(10, 111)]
        assert all(a >= b for a, b in itertools.pairwise(values))


def test_constant_and_zero_min():
    assert [lr_factor(s, cfg(scheduler="constant"), 10) for s in (0, 5, 9, 20)] == [1.0] * 4
    assert lr_factor(10, cfg(scheduler="cosine"), 10) == pytest.approx(0.0, abs=1e-15)


def test_scheduler_drives_the_optimizer_lr():
    c = cfg(scheduler="cosine", warmup_steps=2, min_lr_ratio=0.2)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], c)
    sched = build_scheduler(opt, c, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.zeros(1)
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * lr_factor(s, c, 6) for s in range(6)], rel=1e-12)
    assert seen[0] == pytest.approx(0.05) and seen[1] == pytest.approx(0.1)


def test_build_optimizer_choice_and_frozen_params():
    a, frozen = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    opt = build_optimizer([a, frozen], OptimConfig(name="adamw", lr=0.01, betas=(0.8, 0.9), weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert opt.param_groups[0]["params"] == [a]
    sgd = build_optimizer([a], OptimConfig(name="sgd", lr=0.01, momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
