"""The rollout-trainer gap's metrics against a plain computation, over the old-log-prob pass and
measured inside a one-update rollout's forward (the same figures)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from exactrl.checks.rollout_gap import rollout_gap_metrics
from exactrl.data.batch import Sample
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.objective import Metrics
from exactrl.losses.rollout_gap import RolloutGap
from exactrl.rollout.hf import HFEngine
from exactrl.workers.worker import Worker
from rl_helpers import attach_logprobs
from test_kept_set import sampled


def plain_metrics(trainer: list[list[float]], gen: list[list[float]], cap: float) -> dict[str, float]:
    """The gap's metrics written out over per-sequence lists of the policy's sampled tokens."""
    deltas = [a - b for t, g in zip(trainer, gen) for a, b in zip(t, g)]
    rhos = [math.exp(d) for d in deltas]
    return {"rollout_gap/abs_mean": sum(abs(d) for d in deltas) / len(deltas),
            "rollout_gap/abs_max": max(abs(d) for d in deltas),
            "rollout_gap/k1": sum(-d for d in deltas) / len(deltas),
            "rollout_gap/k3": sum(r - 1 - d for r, d in zip(rhos, deltas)) / len(deltas),
            "rollout_gap/chi2_token": sum((r - 1) ** 2 for r in rhos) / len(rhos),
            "rollout_gap/chi2_seq": sum((math.exp(sum(t) - sum(g)) - 1) ** 2 for t, g in zip(trainer, gen)
                                        if t) / sum(1 for t in trainer if t),
            "rollout_gap/outside_frac": sum(not 1 / cap <= r <= cap for r in rhos) / len(rhos)}


def gap_samples(kept: bool) -> tuple[list[Sample], list[list[float]], list[list[float]]]:
    """An on-policy sample, a demonstration (never sampled: left out) and a hinted sample whose
    first response tokens are a demonstration's prefix (left out too), with known log-probs."""
    g = torch.Generator().manual_seed(4)
    specs = [((5, 6, 7), (8, 9, 10, 11), "on_policy", 0), ((5, 6), (12, 13, 14), "demonstration", 0),
             ((5, 6, 7, 8), (9, 10, 11, 12, 13), "on_policy", 2)]
    samples, trainer, gen = [], [], []
    for prompt, response, source, hint in specs:
        n = len(prompt) + len(response) - 1
        old, gen_lp = -torch.rand(n, generator=g), -torch.rand(n, generator=g)
        origin = None if not hint else ("policy",) * (len(prompt) - 1) + ("demonstration",) * hint + ("policy",) * (
            len(response) - hint)
        # over the kept set the trainer's full-vocabulary log-probs are lower; the kept ones are compared
        samples.append(Sample(list(prompt), list(response), source=source, origin=origin, gen_logprobs=gen_lp,
                              old_logprobs=old - 0.3 if kept else old, old_kept_logprobs=old if kept else None))
        policy = [] if source != "on_policy" else list(range(len(prompt) - 1 + hint, n))
        trainer.append([old[i].item() for i in policy])
        gen.append([gen_lp[i].item() for i in policy])
    return samples, trainer, gen


@pytest.mark.parametrize("kept", [False, True], ids=["vocabulary", "kept-set"])
def test_gap_metrics_against_a_plain_computation(kept):
    samples, trainer, gen = gap_samples(kept)
    got = rollout_gap_metrics(samples, RolloutGap(kept=kept, gap_cap=1.5))
    assert got == pytest.approx(plain_metrics(trainer, gen, 1.5), rel=1e-6, abs=1e-12)
    samples[0].gen_logprobs = None  # a rollout without generator log-probs has nothing to compare
    assert rollout_gap_metrics(samples, RolloutGap()) == {}


def test_a_one_update_rollout_measures_the_gap_in_its_forward(tokenizer, make_model):
    """Without an old-log-prob pass the update's forward measures the gap (micro-batches of
    different sizes, reduced as the step's metrics): the same figures as over the pass."""
    from exactrl.algorithms.registry import ALGORITHMS
    from exactrl.distributed.engine import build_engine
    from test_rl import rl_cfg

    model, cfg = make_model(2), rl_cfg("rollout.temperature=0.9")
    samples = sampled(tokenizer, HFEngine(model, tokenizer, batch_size=8), temperature=0.9)
    for i, s in enumerate(samples):  # a known gap on top of decoding's rounding
        s.gen_logprobs = s.gen_logprobs + 0.05 * torch.randn(len(s.gen_logprobs), generator=torch.Generator(
        ).manual_seed(i)) * torch.tensor(s.loss_mask)
    gap = RolloutGap(gap_cap=1.03)
    objective = ALGORITHMS.lookup("grpo").objective(cfg).with_term("policy", old="self").with_gap(gap, measure=True)
    worker = Worker("policy", model, build_engine(model, cfg, 1), pad_id=tokenizer.pad_token_id, temperature=0.9)
    plan = plan_step([len(s.response_ids) for s in samples], 3, "token-mean")
    m = Metrics()
    for mb in plan.micro_batches:
        worker.micro_batch([samples[i] for i in mb], objective, dict.fromkeys(objective.groups(), plan.normalizer), m)
    in_step = {k: v for k, v in m.result().items() if k.startswith("rollout_gap/")}
    attach_logprobs(model, samples, "old_logprobs", [list(range(8))], tokenizer.pad_token_id, 0.9,
                    contextlib.nullcontext)
    over_pass = rollout_gap_metrics(samples, gap)
    assert set(in_step) == set(over_pass) and 0.01 < over_pass["rollout_gap/outside_frac"] < 0.99
    assert in_step == pytest.approx(over_pass, rel=1e-5, abs=1e-7)
