"""Multi-turn trajectories under the RL objective (issue 37): observation and template tokens carry no gradient, and
the update over episodes split across micro-batches and ranks is the full batch's.

The episodes (tests/dist/multiturn_references.py) are rollout/multiturn.py's rows: policy turns, the template's
closing ids and observations wrapped in template ids, with very different token counts per row, and an advantage,
old and reference log-probs on every target (so only the mask keeps non-policy tokens out). The objective is
GRPO's clipped surrogate with a k3 KL and an entropy bonus, as the algorithm registry builds it.

1. The gradient of one micro-batch's loss with respect to the logits is exactly 0 at every target whose origin is
   template or environment (and at prompt and padding positions), nonzero at every policy target, padded and
   packed; a mask that counts one observation target shows up as exactly that target.
2. One float64 SGD step through Worker.train_step for micro-batches of 1, 2 and the whole batch, in every
   aggregation mode, equals one SGD step on the loss written out over the whole batch's policy tokens (bound 1e-10,
   distributed_harness.TOL); the peers' per-micro-batch mean of means does not; a normaliser that counts template
   and environment tokens does not (the canary stops it too). At world size 2 on FSDP2 and DeepSpeed ZeRO-2 with
   the optimizer offloaded: tests/dist/multiturn_equivalence.py.
3. An episode its environment ended at reset (a row without a policy token) is no sequence of any normaliser.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from equivalence import relative_error
from multiturn_references import MODES, fresh_model, make_samples, overrides, sgd_reference, token_counts

from distributed_harness import TOL, over_bound, run_cases
from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.rl import step_plan
from exactrl.checks.canary import CanaryError
from exactrl.config import RLConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.losses.aggregation import StepNormalizer
from exactrl.losses.objective import Metrics, Objective
from exactrl.workers.worker import Worker

SCRIPT = Path(__file__).parent / "dist" / "multiturn_equivalence.py"


@pytest.fixture(scope="module")
def rollout(tokenizer):
    samples, episodes = make_samples(tokenizer)
    counts = token_counts(samples)
    # what the tests lean on: rows of every origin, of very different sizes
    assert min(counts["environment"]) > 0 and min(counts["template"]) > 0
    assert max(counts["policy"]) >= 2 * min(counts["policy"]) and max(counts["environment"]) >= 5 * min(
        counts["environment"])
    return samples, episodes


@pytest.fixture(scope="module")
def references(tokenizer, rollout):
    """Each mode's (parameters after the reference step, its loss)."""
    return {mode: sgd_reference(tokenizer, *rollout, mode) for mode in MODES}


def policy_worker(tok, cfg, packed=None):
    model = fresh_model(tok)
    engine = build_engine(model, cfg, total_steps=1)
    return Worker("policy", model, engine, pad_id=tok.pad_token_id,
                  packed=cfg.train.padding_free if packed is None else packed, temperature=cfg.rollout.temperature)


def target_gradients(tok, samples, mode: str, packed: bool) -> list[torch.Tensor]:
    """Per row, the largest |d loss / d logit| at each of its positions (target t is position t; the row's last
    position predicts nothing), from one micro-batch of all ``samples`` through Worker.micro_batch; through
    the output head (exactrl/models/head.py) the largest |d loss / d field| of target t."""
    cfg = load_config(RLConfig, None, overrides(mode, len(samples)))
    worker, objective = policy_worker(tok, cfg, packed), ALGORITHMS.lookup("grpo").objective(cfg)
    assert {t.kind for t in objective.terms} == {"policy", "kl", "entropy"}
    seen = []

    def keep(module, args, out):  # returns None: the output stays the model's
        out.logits.retain_grad()
        seen.append(out.logits)

    hook = worker.model.register_forward_hook(keep)
    loss, _, _ = worker.micro_batch(samples, objective, objective.normalizers(step_plan(samples, cfg, 1)), Metrics())
    hook.remove()
    loss.backward()
    grad = seen[0].grad.abs().amax(-1)
    lengths = [len(s.ids) for s in samples]
    if worker.logprob_chunk > 0:  # the chunked head returns the per-target fields: d loss / d field, one fewer
        grad = torch.nn.functional.pad(grad, (0, 1))
    if packed:  # one row: sequence b's positions follow the ones before it
        assert grad.shape == (1, sum(lengths))
        return list(grad[0].split(lengths))
    assert grad.shape == (len(samples), max(lengths))
    return list(grad)


def leaks(samples, grads) -> tuple[list, list]:
    """(row, position, origin) of each non-policy position with a nonzero gradient, and each policy target without."""
    leaked, silent = [], []
    for b, (s, g) in enumerate(zip(samples, grads)):
        head, origin = len(s.prompt_ids) - 1, s.token_origins
        for t in range(len(g)):
            policy = head <= t < s.num_targets and origin[t] == "policy"
            kind = origin[t] if head <= t < s.num_targets else "prompt" if t < head else "none"
            if not policy and g[t] != 0:
                leaked.append((b, t, kind))
            if policy and not g[t] > 0:
                silent.append((b, t))
    return leaked, silent


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", MODES)
def test_template_and_environment_targets_get_exactly_zero_gradient(tokenizer, rollout, mode, packed):
    samples, _ = rollout
    grads = target_gradients(tokenizer, samples, mode, packed)
    leaked, silent = leaks(samples, grads)
    assert leaked == [] and silent == [], (leaked[:8], silent[:8])
    assert sum(int((g > 0).sum()) for g in grads) == sum(s.loss_tokens for s in samples)


def test_a_mask_that_counts_an_observation_target_shows_up(tokenizer, rollout):
    """The check above can fail: one environment target of row 1 counted in its mask gets a gradient, and it is the
    only position that does."""
    samples, _ = rollout
    s = copy.copy(samples[1])
    head = len(s.prompt_ids) - 1
    t = next(t for t in range(head, s.num_targets) if s.origin[t] == "environment")
    s.mask = s.mask[:t] + (1,) + s.mask[t + 1 :]
    leaked, silent = leaks([samples[0], s, *samples[2:]],
                           target_gradients(tokenizer, [samples[0], s, *samples[2:]], "token-mean", packed=True))
    assert leaked == [(1, t, "environment")] and silent == []


def train_step(tok, samples, mode: str, micro: int, micro_means: bool = False, extra: tuple[str, ...] = ()):
    """(parameters after one SGD step through Worker.train_step, its result). ``micro_means``: the peers'
    per-micro-batch mean of means (losses/aggregation.py micro_batch_normalizer)."""
    cfg = load_config(RLConfig, None, [*overrides(mode, micro), *extra])
    worker = policy_worker(tok, cfg)
    plan = replace(step_plan(samples, cfg, 1), micro_means=micro_means)
    result = worker.train_step(samples, plan, ALGORITHMS.lookup("grpo").objective(cfg))
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}, result


@pytest.mark.parametrize("micro", [1, 2, 8], ids=["micro1", "micro2", "whole"])
@pytest.mark.parametrize("mode", MODES)
def test_the_update_is_the_full_batch_reference_s(tokenizer, rollout, references, mode, micro):
    samples, _ = rollout
    got, result = train_step(tokenizer, samples, mode, micro)
    ref, value = references[mode]
    err = relative_error(got, ref, fresh_model(tokenizer).state_dict())
    assert err <= TOL["float64"], err
    assert result.loss == pytest.approx(value, rel=1e-12)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)  # an fp32 parameter: its shares round


@pytest.mark.parametrize("micro", [1, 2])
def test_the_peers_mean_of_means_is_another_update(tokenizer, rollout, references, micro):
    """Each micro-batch normalised by its own policy tokens, averaged over the micro-batches (OpenRLHF <= 0.10.2):
    on these rows of 15 to 37 policy tokens it is measurably off the full batch's token mean."""
    samples, _ = rollout
    got, _ = train_step(tokenizer, samples, "token-mean", micro, True)
    err = relative_error(got, references["token-mean"][0], fresh_model(tokenizer).state_dict())
    print(f"token-mean, micro-batches of {micro}: the per-micro-batch mean of means is off by {err:.3g}")
    assert err > 1e-3, err


def test_a_normaliser_that_counts_template_and_environment_tokens_fails(tokenizer, rollout, references, monkeypatch):
    """The step's token count taken over every response target (policy, template and environment) instead of the
    policy's: the update is off the reference by far more than the bound, and the canary (on by default) stops it."""
    samples, _ = rollout
    every = sum(s.num_targets - len(s.prompt_ids) + 1 for s in samples)
    assert every > 2 * sum(s.loss_tokens for s in samples)

    def counting_everything(self, plan):
        return {key: StepNormalizer(key[2], every, len(samples), key[3]) for key in self.groups()}

    monkeypatch.setattr(Objective, "normalizers", counting_everything)
    got, _ = train_step(tokenizer, samples, "token-mean", 2, extra=("audit.canary=off",))
    err = relative_error(got, references["token-mean"][0], fresh_model(tokenizer).state_dict())
    print(f"a token-mean normaliser counting template and environment tokens: off by {err:.3g}")
    assert err > 1e-3, err
    with pytest.raises(CanaryError):
        train_step(tokenizer, samples, "token-mean", 2)


@pytest.fixture(scope="module")
def failed_reset(tokenizer):
    """The rollout with episode 2's environment failing at reset: its row is its prompt alone, reward 0."""
    with pytest.warns(UserWarning, match="reset failed"):
        samples, episodes = make_samples(tokenizer, failed_resets=(2,))
    assert [s.loss_tokens == 0 for s in samples] == [i == 2 for i in range(8)]
    # a row without turns carries zero generator log-probs, as collate needs beside the sampled rows'
    assert not samples[2].gen_logprobs.any() and all(s.gen_logprobs is not None for s in samples)
    return samples, episodes


@pytest.mark.parametrize("mode", MODES)
def test_an_episode_without_a_policy_token_is_no_sequence_of_the_step(tokenizer, failed_reset, mode):
    """The row of an episode that ended before its first turn adds no loss and is no sequence of any normaliser:
    counted in S, a seq-mean mode would weigh every other sequence 7/8 of the reference's (seq-mean-token-sum, -norm)
    or the canary would stop the step (seq-mean-token-mean: the shares sum to 7/8)."""
    samples, episodes = failed_reset
    got, result = train_step(tokenizer, samples, mode, 2)
    ref, value = sgd_reference(tokenizer, samples, episodes, mode)
    err = relative_error(got, ref, fresh_model(tokenizer).state_dict())
    assert err <= TOL["float64"], err
    assert result.loss == pytest.approx(value, rel=1e-12)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)


def test_world_size_two_applies_the_full_batch_update(tmp_path):
    """Every aggregation mode through Worker.train_step on two gloo ranks of four episodes (FSDP2 in float64 for
    micro-batches of 1 and 2; DeepSpeed ZeRO-2 with the optimizer offloaded, fp32 master weights, micro-batches of 1:
    four accumulation steps per rank), both backends in one launch: one SGD step is the one-pass reference's; the
    peers' per-micro-batch mean of means is not."""
    from old_deepspeed import ds_env

    deepspeed = importlib.util.find_spec("deepspeed") is not None
    backends = ["fsdp2", *(["deepspeed"] if deepspeed else [])]
    r = run_cases(",".join(backends), 2, tmp_path / "out.json", ds_env() if deepspeed else None, script=SCRIPT)
    assert list(r) == backends
    for backend, b in r.items():
        cases = b["cases"]
        assert {c["mode"] for c in cases} == set(MODES) and all(c["samples_per_rank"] == [4, 4] for c in cases)
        assert not over_bound(cases), cases
        assert all(abs(c["canary"] - 1) < 1e-6 and c["loss_rel_diff"] < 1e-6 for c in cases), cases
        print(f"{backend} world 2: " + ", ".join(f"{c['mode']} micro {c['micro']} {c['rel_err']:.2g}" for c in cases),
              f"({cases[0]['precision']}); the peers' mean of means {b['peers']['rel_err']:.3g}")
        assert b["peers"]["rel_err"] > 1e-3, b["peers"]
