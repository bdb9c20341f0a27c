"""The aggregation modes against hand-computed values, and the one rule of the maths:
micro-batch shares add up to the full-batch loss, unlike a mean of per-micro-batch means."""

from __future__ import annotations

import pytest
import torch

from exactrl.distributed.step_plan import plan_step
from exactrl.losses.aggregation import AGG_MODES, StepNormalizer, aggregate

# Two sequences with token losses [1, 2, 3] and [4]; padding positions hold junk (99) that
# the mask must remove.
LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
C = 5.0

HAND = {
    "token-mean": 10 / 4,  # (1+2+3+4) / 4 tokens
    "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,  # (mean of [1,2,3] + mean of [4]) / 2 seqs
    "seq-mean-token-sum": (6 + 4) / 2,  # (sum of [1,2,3] + sum of [4]) / 2 seqs
    "seq-mean-token-sum-norm": (6 + 4) / (2 * C),  # token sums / (2 seqs x constant length 5)
}


def norm(mode: str, num_tokens: int = 4, num_seqs: int = 2) -> StepNormalizer:
    return StepNormalizer(mode=mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=C)


def test_hand_table_covers_every_mode():
    assert set(HAND) == set(AGG_MODES)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_full_batch_value_matches_hand_computation(mode):
    got = aggregate(LOSSES, MASK, norm(mode))
    assert got.item() == pytest.approx(HAND[mode], rel=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_shares_sum_to_full_batch_value(mode):
    # One sequence per micro-batch, each padded only to its own width (as collate does).
    share0 = aggregate(LOSSES[:1], MASK[:1], norm(mode))
    share1 = aggregate(LOSSES[1:, :1], MASK[1:, :1], norm(mode))
    assert (share0 + share1).item() == pytest.approx(HAND[mode], rel=1e-7)


def test_mean_of_means_is_a_different_number():
    """The OpenRLHF <= 0.9.10 bug: averaging per-micro-batch token means. On these uneven
    micro-batches (3 tokens, 1 token) it gives (2 + 4) / 2 = 3, not 10 / 4 = 2.5, so the
    share test above would fail for an implementation that did this."""
    mean0 = (LOSSES[0] * MASK[0]).sum() / MASK[0].sum()
    mean1 = (LOSSES[1] * MASK[1]).sum() / MASK[1].sum()
    mean_of_means = ((mean0 + mean1) / 2).item()
    assert mean_of_means == pytest.approx(3.0)
    assert abs(mean_of_means - HAND["token-mean"]) > 0.4
    # A per-micro-batch normaliser (what "mean of means" amounts to) breaks the share sum.
    wrong = aggregate(LOSSES[:1], MASK[:1], norm("token-mean", num_tokens=3, num_seqs=1)) + aggregate(
        LOSSES[1:, :1], MASK[1:, :1], norm("token-mean", num_tokens=1, num_seqs=1)
    )
    assert abs(wrong.item() / 2 - HAND["token-mean"]) > 0.4


def _reference(losses: list[list[float]], mode: str, c: float) -> float:
    """The modes' definitions over python lists of per-sequence token losses (no padding)."""
    s = len(losses)
    t = sum(len(x) for x in losses)
    if mode == "token-mean":
        return sum(sum(x) for x in losses) / t
    if mode == "seq-mean-token-mean":
        return sum(sum(x) / len(x) for x in losses) / s
    if mode == "seq-mean-token-sum":
        return sum(sum(x) for x in losses) / s
    return sum(sum(x) for x in losses) / (s * c)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 4, 6, 12])
def test_random_uneven_split_matches_definition(mode, micro_batch_size):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 17, 3, 40, 2, 9, 25, 1, 5, 33, 8, 4]
    seqs = [torch.rand(n, generator=g, dtype=torch.float64).tolist() for n in lengths]
    plan = plan_step(lengths, micro_batch_size, mode, norm_len=32.0)
    total = 0.0
    for mb in plan.micro_batches:
        width = max(lengths[i] for i in mb)
        loss = torch.full((len(mb), width), 1e6, dtype=torch.float64)  # junk in the padding
        mask = torch.zeros(len(mb), width)
        for row, i in enumerate(mb):
            loss[row, : lengths[i]] = torch.tensor(seqs[i], dtype=torch.float64)
            mask[row, : lengths[i]] = 1
        total += aggregate(loss, mask, plan.normalizer).item()
    assert total == pytest.approx(_reference(seqs, mode, 32.0), rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_of_share_is_the_sequence_weight(mode):
    losses = LOSSES.clone().requires_grad_(True)
    aggregate(losses, MASK, norm(mode)).backward()
    w = {"token-mean": [1 / 4, 1 / 4], "seq-mean-token-mean": [1 / (2 * 3), 1 / (2 * 1)],
         "seq-mean-token-sum": [1 / 2, 1 / 2], "seq-mean-token-sum-norm": [1 / (2 * C), 1 / (2 * C)]}[mode]
    expected = torch.tensor([[w[0]] * 3, [w[1], 0.0, 0.0]])
    torch.testing.assert_close(losses.grad, expected, rtol=1e-7, atol=0)


def test_sequence_without_loss_tokens_contributes_nothing():
    losses = torch.tensor([[1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    got = aggregate(losses, mask, norm("seq-mean-token-mean", num_tokens=3, num_seqs=2))
    assert torch.isfinite(got) and got.item() == pytest.approx((6 / 3 + 0) / 2)


def test_normalizer_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation 'token-sum'"):
        StepNormalizer(mode="token-sum", num_tokens=4, num_seqs=2)


@pytest.mark.parametrize("norm_len", [None, 0])
def test_normalizer_requires_norm_len_for_dr_grpo(norm_len):
    with pytest.raises(ValueError, match="loss_agg_norm"):
        StepNormalizer(mode="seq-mean-token-sum-norm", num_tokens=4, num_seqs=2, norm_len=norm_len)


@pytest.mark.parametrize("tokens,seqs", [(0, 2), (4, 0), (0, 0)])
def test_normalizer_rejects_empty_step(tokens, seqs):
    with pytest.raises(ValueError, match="nothing to learn from"):
        StepNormalizer(mode="token-mean", num_tokens=tokens, num_seqs=seqs)


def test_plan_step_covers_each_sample_once_and_counts_the_whole_step():
    tokens = [5, 1, 9, 2, 7, 3]
    lengths = [50, 10, 90, 20, 70, 30]
    plan = plan_step(tokens, 2, "token-mean", lengths=lengths)
    flat = [i for mb in plan.micro_batches for i in mb]
    assert sorted(flat) == list(range(6)) and plan.num_samples == 6
    assert all(len(mb) == 2 for mb in plan.micro_batches)
    # Length grouping: samples of similar padded length share a micro-batch.
    assert plan.micro_batches == ((1, 3), (5, 0), (4, 2))
    assert plan.normalizer.num_tokens == 27 and plan.normalizer.num_seqs == 6
    assert plan_step(tokens, 3, "token-mean").micro_batches == ((0, 1, 2), (3, 4, 5))


@pytest.mark.parametrize("n,mbs,world,unit,sizes", [
    (6, 4, 1, 1, (3, 3)), (5, 2, 1, 1, (2, 2, 1)), (6, 2, 2, 1, (2, 2, 1, 1)), (9, 4, 2, 1, (3, 2, 2, 2)),
    (10, 4, 1, 2, (4, 4, 2)), (8, 2, 1, 1, (2, 2, 2, 2))])
def test_plan_step_splits_a_batch_that_does_not_fill_its_micro_batches(n, mbs, world, unit, sizes):
    """A mixed-policy step holds as many samples as its demonstrations make: the fewest
    micro-batches of at most micro_batch_size, the same number on every rank, units whole."""
    plan = plan_step([1] * n, mbs, "token-mean", world_size=world, unit=unit)
    assert tuple(len(mb) for mb in plan.micro_batches) == sizes
    assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(n))
    assert all(mb[0] % unit == 0 for mb in plan.micro_batches)
    assert len({len(plan.for_rank(r).micro_batches) for r in range(world)}) == 1


@pytest.mark.parametrize("n,mbs,world", [(0, 1, 1), (1, 1, 2), (3, 4, 4)])
def test_plan_step_refuses_a_batch_too_small_for_every_rank(n, mbs, world):
    with pytest.raises(ValueError, match="does not split"):
        plan_step([1] * n, mbs, "token-mean", world_size=world)
