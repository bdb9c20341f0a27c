"""The generator interface (exactrl/rollout/generator.py) on the HF decode loop: weights arrive
through load_weights and are verified, every generation carries the version it was sampled
with, and the worker's per-token forward matches a plain full-batch computation."""

from __future__ import annotations

import pytest
import torch

from exactrl.data.batch import Sample
from exactrl.rollout.generator import SamplingParams, WeightSyncError
from exactrl.rollout.hf import HFEngine
from exactrl.workers.worker import Worker


def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ("12+3=", "7+40=", "5+5=")]


def sampled(gen, tokenizer):
    torch.manual_seed(0)
    return gen.generate(prompts(tokenizer), SamplingParams(n=2, max_new_tokens=8))


def test_load_weights_from_another_model_makes_it_generate_as_that_model(tokenizer, make_model):
    target, other = make_model(seed=1), make_model(seed=2)
    want = sampled(HFEngine(target, tokenizer, 8), tokenizer)
    gen = HFEngine(other, tokenizer, 8)
    before = sampled(gen, tokenizer)
    assert [g.logprobs for g in before] != [g.logprobs for g in want]  # the two models differ
    assert gen.load_weights(target.named_parameters()) == 1
    got = sampled(gen, tokenizer)
    assert [(g.response_ids, g.logprobs) for g in got] == [(g.response_ids, g.logprobs) for g in want]
    assert {g.weights_version for g in before} == {0} and {g.weights_version for g in got} == {1}


def test_the_trainers_own_parameters_are_taken_without_a_copy(tokenizer, make_model):
    model = make_model(seed=1)
    gen = HFEngine(model, tokenizer, 8)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert gen.load_weights(model.named_parameters()) == 1 and gen.load_weights(model.named_parameters()) == 2
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_weights_that_do_not_fit_are_refused(tokenizer, make_model):
    gen = HFEngine(make_model(seed=1), tokenizer, 8)
    with pytest.raises(WeightSyncError, match="no parameter 'lm_head.wrong'"):
        gen.load_weights([("lm_head.wrong", torch.zeros(1))])
    assert gen.weights_version == 0


def test_keyword_sampling_params_equal_the_dataclass(tokenizer, make_model):
    gen = HFEngine(make_model(seed=3), tokenizer, 8)
    torch.manual_seed(0)
    a = gen.generate(prompts(tokenizer), n=2, temperature=0.7, max_new_tokens=6)
    torch.manual_seed(0)
    b = gen.generate(prompts(tokenizer), SamplingParams(n=2, temperature=0.7, max_new_tokens=6))
    assert [(g.response_ids, g.logprobs) for g in a] == [(g.response_ids, g.logprobs) for g in b]


@pytest.mark.parametrize("packed", [False, True])
def test_worker_forward_gives_each_sample_its_full_batch_log_probs(tokenizer, make_model, packed):
    model = make_model(seed=4)
    samples = [Sample(p, [7, 8, 9][: i + 1]) for i, p in enumerate(prompts(tokenizer))]
    got = Worker("policy", model, pad_id=tokenizer.pad_token_id, packed=packed, temperature=0.5).forward(
        samples, "logprobs", [[[0, 2], [1]]])
    for s, row in zip(samples, got):  # one sequence alone, no padding, no packing
        ids = torch.tensor([s.ids])
        want = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / 0.5, -1).gather(-1, ids[0, 1:, None])[
            :, 0]
        assert row.shape == (s.num_targets,)
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="computed for no micro-batch holding samples \\[1\\]"):
        Worker("policy", model, pad_id=tokenizer.pad_token_id).forward(samples, "logprobs", [[[0, 2]]])
