"""A rollout that feeds a single update skips the old-log-prob pass: the generator's recorded
log-probs against a training forward, the loss and gradient with and without the pass, the
on-policy check against the generator, and which configurations reuse the forward."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from exactrl.algorithms.rl import reuses_first_forward, train_rl
from exactrl.checks.on_policy import OnPolicyCheckError, on_policy_check
from exactrl.config import RLConfig, load_config
from exactrl.data.batch import Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.builtin import BuiltinSpec
from rl_helpers import attach_logprobs, consecutive, policy_micro_batch_loss
from test_rl import response_advantages, rl_cfg


def generated_samples(tokenizer, model, temperature=0.7, top_p=1.0, top_k=0):
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34=")]
    torch.manual_seed(0)
    gens = HFEngine(model, tokenizer, batch_size=8).generate(prompts, n=2, temperature=temperature, top_p=top_p,
                                                             top_k=top_k,
                                                            max_new_tokens=16)
    return [Sample(g.prompt_ids, g.response_ids, 0.0, advantages=response_advantages(g.prompt_ids, g.response_ids, (
        i % 3) - 1.0),
                   gen_logprobs=torch.tensor([0.0] * (len(g.prompt_ids) - 1) + g.logprobs)) for i, g in enumerate(gens)]


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.8, 0), (1.0, 4), (0.8, 4)])
def test_generator_records_the_logprobs_the_loss_computes(tokenizer, make_model, top_p, top_k):
    """What the engine sampled with (at the temperature, before any top-k/top-p cut) against a
    separate training forward of the same samples."""
    model = make_model(5)
    samples = generated_samples(tokenizer, model, 0.7, top_p, top_k)
    attach_logprobs(model, samples, "old_logprobs", consecutive(len(samples), 3), tokenizer.pad_token_id, 0.7,
                    contextlib.nullcontext)
    for s in samples:
        resp = slice(len(s.prompt_ids) - 1, None)
        assert (s.gen_logprobs[resp] - s.old_logprobs[resp]).abs().max() < 1e-5


def test_one_update_rollout_reuses_its_forward_and_checks_the_generator(tokenizer, make_model):
    """Without an old-log-prob pass the loss and gradient are those with one; the ratio check
    then reads the generator's log-probs, so a corrupted one is caught."""
    cfg = rl_cfg("train.micro_batch_size=8", "rollout.temperature=0.7")
    results = {}
    for reuse in (False, True):
        model = make_model(6)
        samples = generated_samples(tokenizer, model)
        if not reuse:
            attach_logprobs(model, samples, "old_logprobs", [list(range(8))], tokenizer.pad_token_id, 0.7,
                            contextlib.nullcontext)
        plan = plan_step([len(s.response_ids) for s in samples], 8, cfg.train.loss_agg, 16.0)
        loss, _, m = policy_micro_batch_loss(model, build_engine(model, cfg, 1), samples, plan.normalizer, cfg,
                                             tokenizer.pad_token_id)
        loss.backward()
        results[reuse] = (loss.item(), m["ratio_dev"], torch.cat([p.grad.flatten() for p in model.parameters()]))
    (l0, d0, g0), (l1, d1, g1) = results[False], results[True]
    assert abs(l1 - l0) <= 1e-6 * abs(l0) and (g1 - g0).norm() <= 1e-5 * g0.norm()
    assert d0 < 1e-6 and d1 < 1e-5  # the generator's log-probs agree with the training forward
    samples[3].gen_logprobs[-1] += 0.05
    _, _, m = policy_micro_batch_loss(model, build_engine(model, cfg, 1), samples, plan.normalizer, cfg,
                                      tokenizer.pad_token_id)
    assert m["ratio_dev"] > 0.04
    with pytest.raises(OnPolicyCheckError, match="generator's log-probs"):
        on_policy_check(cfg, rollout=3, against_generator=True).verify(m["ratio_dev"])
    # Against the generator the check allows decoding's rounding (algo.gen_ratio_tol), not ratio_tol.
    on_policy_check(cfg, rollout=3, against_generator=True).verify(2.4e-4)
    with pytest.raises(OnPolicyCheckError, match="old log-probs"):
        on_policy_check(cfg, rollout=3).verify(2.4e-4)


def test_which_rollouts_reuse_the_update_forward(tokenizer, make_model):
    samples = generated_samples(tokenizer, make_model(7))
    assert reuses_first_forward(rl_cfg(), samples)
    for other in (["algo.mini_batches=2"], ["algo.ppo_epochs=2"], ["algo.kl_coef=0.1"], ["model.dtype=bf16"]):
        assert not reuses_first_forward(rl_cfg(*other), samples), other
    samples[0].gen_logprobs = None  # a generator that recorded nothing
    assert not reuses_first_forward(rl_cfg(), samples)


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_a_run_with_top_k_and_stop_strings_stays_on_policy(tmp_path, ppo_epochs):
    """rollout.top_k and rollout.stop end to end: the generation self-check and the on-policy
    check (against the generator's log-probs with one update per rollout, tightened to 1e-4;
    against the old-log-prob pass with two) pass, and responses end at the stop string."""
    cfg = load_config(RLConfig, None, [
        "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
        "train.max_steps=2",
        "train.log_every=1", f"algo.ppo_epochs={ppo_epochs}", "algo.gen_ratio_tol=1e-4", "train.generation_check=error",
        "rollout.top_k=3",
        "rollout.stop=['8']", "rollout.temperature=1.5", "rollout.max_new_tokens=16", f"output_dir={tmp_path}"])
    result = train_rl(cfg, spec=BuiltinSpec(n_sft=64, n_rl=16, n_eval=8))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["finished"] > 0 and r["response_length"] < 16 for r in rows)
    firsts = [r["ratio_dev_first"] for r in rows if r.get("ratio_dev_first") is not None]  # one per rollout
    assert len(firsts) == 2 // ppo_epochs and max(firsts) < 1e-4
