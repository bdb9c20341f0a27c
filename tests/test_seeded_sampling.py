"""Per-request seeded sampling (exactrl/rollout/generator.py, hf.py): a response depends on its
key alone -- not on its batch, the batch size, its place in the batch, or rows leaving the batch
-- and it is drawn from exactly Hugging Face's distribution (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from exactrl.rollout.generator import prompt_seeds, row_seed
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.sampling import draw, warp


def same(a, b) -> bool:
    """The same tokens; log-probs as close as fp32 forwards of differently shaped batches get."""
    return ([(g.prompt_index, g.response_ids) for g in a] == [(g.prompt_index, g.response_ids) for g in b]
            and all((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max() < 1e-5 for x, y in zip(a, b)))


def test_a_response_depends_on_its_key_not_on_its_batch(tokenizer, make_model):
    """The same prompts and seeds in one batch of 12 rows, in batches of 5 (rows finishing and
    leaving at other steps), and in another order: the same responses, token for token."""
    model = make_model(4).eval()
    texts = ("1+2=", "345+678=", "9=", "12+34=")
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    seeds = prompt_seeds(7, 0, 0, positions=range(4))
    kw = {"n": 3, "temperature": 1.3, "top_p": 0.95, "max_new_tokens": 10}
    whole = HFEngine(model, tokenizer, batch_size=12).generate(prompts, seeds=seeds, **kw)
    fives = HFEngine(model, tokenizer, batch_size=5).generate(prompts, seeds=seeds, **kw)
    assert same(whole, fives)
    order = [2, 0, 3, 1]
    shuffled = HFEngine(model, tokenizer, batch_size=12).generate([prompts[i] for i in order],
                                                                  seeds=[seeds[i] for i in order], **kw)
    regrouped = [g for i in order for g in whole if g.prompt_index == i]
    assert [g.response_ids for g in shuffled] == [g.response_ids for g in regrouped]
    assert max((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max() for x, y in zip(
        shuffled, regrouped)) < 1e-5
    assert len({tuple(g.response_ids) for g in whole}) >= 10  # the keys give different responses
    other = HFEngine(model, tokenizer, batch_size=12).generate(prompts, seeds=prompt_seeds(7, 1, 0, positions=range(4)),
                                                               **kw)
    assert [g.response_ids for g in other] != [g.response_ids for g in whole]


def test_the_engine_refuses_a_seed_count_that_does_not_match(tokenizer, make_model):
    with pytest.raises(ValueError, match="one seed per prompt: 2 prompts, 1 seeds"):
        HFEngine(make_model(4), tokenizer, 4).generate([[1, 5], [1, 6]], seeds=[3], max_new_tokens=2)


def test_keys_differ_by_every_part():
    keys = {prompt_seeds(s, r, k, positions=[p])[0] for s in (0, 1) for r in (0, 1) for k in (0, 1) for p in (0, 1)}
    assert len(keys) == 16 and all(0 <= k < 2**63 for k in keys)
    assert row_seed(5, 0) != row_seed(5, 1) and row_seed(5, 0) == row_seed(5, 0)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.9, 0.6, 7),
                                                     (1.0, 0.0, 0)])
def test_the_kept_distribution_is_hugging_faces(temperature, top_p, top_k):
    """warp against transformers' own warpers in generate's order, on logits with ties at the cuts."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    logits[:, 10:14] = logits[:, :1]  # ties with the best score
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    want = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)
    scores, logp = warp(logits, temperature, top_p, top_k)
    assert torch.equal(scores.softmax(-1), want)
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, -1))  # before the cuts


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.8, 3)])
def test_the_inverse_cdf_draws_each_token_with_its_probability(top_p, top_k):
    """Uniforms on an even grid of N points: each token is drawn within one of N * p times, and
    never a token outside the kept set."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens, logp = draw(logits.expand(n, -1), False, 1.0, top_p, top_k, u.float())
    probs = warp(logits, 1.0, top_p, top_k)[0].softmax(-1)[0]
    counts = torch.bincount(tokens, minlength=12)
    assert ((counts - n * probs.double()).abs() <= 1.0 + 1e-6).all(), (counts, n * probs)
    assert (counts[probs == 0] == 0).all()
    assert torch.equal(logp, torch.log_softmax(logits, -1)[0, tokens])
    edge = draw(logits, False, 1.0, top_p, top_k, torch.tensor([1 - 2**-24]))[0]  # the largest uniform
    assert probs[edge] > 0
