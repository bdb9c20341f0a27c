"""The top-p/top-k kept set: one definition (exactrl/losses/token_losses.py kept_set) for the decode
loop's draws and the trainer's replay of a generator whose log-probs are over it, against a naive
reference (sort, cumulative mass, cut, renormalise), against draw()'s own picks, and through the
worker's forward against a generator reporting its log-probs over the kept set."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

from exactrl.data.batch import Sample
from exactrl.losses.token_losses import kept_logprobs, kept_set
from exactrl.rollout.generator import SamplingParams, compares_kept_set
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.sampling import draw
from exactrl.workers.worker import Worker
from rl_helpers import consecutive
from test_rl import response_advantages

CUTS = [(0.8, 0), (1.0, 5), (0.7, 5), (0.95, 3), (0.5, 0), (0.9, 1)]


def naive_kept(scores: list[float], top_p: float, top_k: int) -> set[int]:
    """Hugging Face's kept set written out: sort descending, keep the top k (and ties with the
    k-th), then walk down the renormalised probabilities keeping tokens until their mass reaches top_p."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_k:
        order = [i for i in order if scores[i] >= scores[order[top_k - 1]]]
    if top_p >= 1.0:
        return set(order)
    z = sum(math.exp(scores[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += math.exp(scores[i]) / z
        if mass >= top_p:
            break
    return set(kept)


def naive_kept_logprob(scores: list[float], token: int, kept: set[int]) -> float:
    """log p(token) renormalised over ``kept`` and the token itself."""
    return scores[token] - math.log(sum(math.exp(scores[i]) for i in kept | {token}))


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("top_p,top_k", CUTS)
def test_kept_set_and_its_logprobs_match_a_naive_reference(top_p, top_k):
    temperature, logits = 0.7, random_logits(6, 40, 0)
    scores = logits / temperature
    got = kept_set(scores, top_p, top_k)
    want = [naive_kept(row.tolist(), top_p, top_k) for row in scores]
    assert [set(row.nonzero().flatten().tolist()) for row in got] == want
    if top_k:  # ties with the k-th score stay in: the three least likely tokens raised to it
        tied = scores[:1].clone()
        tied[0, tied[0].argsort()[:3]] = tied[0].sort(descending=True).values[top_k - 1]
        kept = set(kept_set(tied, 1.0, top_k)[0].nonzero().flatten().tolist())
        assert kept == naive_kept(tied[0].tolist(), 1.0, top_k) and len(kept) == top_k + 3
    # each row's log-probs of every token (kept ones, and one outside the set: always counted as kept)
    for r, kept in enumerate(want):
        targets = sorted(kept)[:3] + sorted(set(range(40)) - kept)[:1]
        seq_logits = logits[r].expand(len(targets) + 1, 40)[None]
        ids = torch.tensor([[0, *targets]])
        lp = kept_logprobs(seq_logits, ids, temperature, top_p, top_k, chunk=2)[0]
        ref = [naive_kept_logprob(scores[r].tolist(), t, kept) for t in targets]
        assert lp.tolist() == pytest.approx(ref, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("top_p,top_k", CUTS)
def test_the_decode_loop_draws_exactly_the_kept_set(top_p, top_k):
    """draw() (the HF loop's and generate's sampler) picks only kept tokens, and each kept token
    at the uniform in the middle of its share of the kept set's CDF (vocabulary order), so both
    agree with the naive reference on which tokens are kept."""
    temperature, logits = 0.7, random_logits(4, 40, 1).float()
    for row in logits:
        scores = (row.double() / temperature).tolist()
        kept = sorted(naive_kept(scores, top_p, top_k))
        p = [math.exp(scores[i]) for i in kept]
        edges = [sum(p[:j]) / sum(p) for j in range(len(p) + 1)]
        u = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(edges)] + torch.rand(200).tolist())
        token, logp = draw(row.expand(len(u), 40), False, temperature, top_p, top_k, u)
        assert token[: len(kept)].tolist() == kept and set(token.tolist()) <= set(kept)
        # the HF loop's log-probs are over the whole vocabulary (exactrl/rollout/generator.py)
        assert torch.allclose(logp, torch.log_softmax(row / temperature, -1)[token], rtol=1e-6)


class KeptSetEngine(HFEngine):
    """The HF loop reporting its log-probs over the kept set (as vLLM's processed_logprobs), from
    a separate forward of each response renormalised by the naive reference."""

    logprobs_over = "kept"

    def generate(self, prompt_ids, params=None, seeds=None, **kwargs):
        p = params or SamplingParams(**kwargs)
        out = []
        for g in super().generate(prompt_ids, p, seeds):
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([g.prompt_ids + g.response_ids])).logits[0].double()
            scores = (logits[len(g.prompt_ids) - 1 : -1] / p.temperature).tolist()
            out.append(replace(g, logprobs=[naive_kept_logprob(s, tok, naive_kept(s, p.top_p, p.top_k))
                                            for s, tok in zip(scores, g.response_ids)]))
        return out


def sampled(tokenizer, engine, **params) -> list[Sample]:
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34=")]
    gens = engine.generate(prompts, n=2, max_new_tokens=12, **params)
    return [Sample(g.prompt_ids, g.response_ids, 0.0, advantages=response_advantages(g.prompt_ids, g.response_ids,
                                                                                      (i % 3) - 1.0),
                   gen_logprobs=torch.tensor([0.0] * (len(g.prompt_ids) - 1) + g.logprobs)) for i, g in enumerate(gens)]


def test_a_generator_over_the_kept_set_is_matched_by_the_workers_replay(tokenizer, make_model):
    """A generator whose log-probs are over the kept set against the trainer's replay (packed
    micro-batches, one forward for both fields): agree to fp32 rounding; the full-vocabulary
    log-probs are off by the kept mass."""
    model, cut = make_model(3), {"temperature": 0.8, "top_p": 0.7, "top_k": 6}
    engine = KeptSetEngine(model, tokenizer, batch_size=8)
    assert compares_kept_set(engine, 0.7, 6) and not compares_kept_set(engine, 1.0, 0)
    assert not compares_kept_set(HFEngine(model, tokenizer, 8), 0.7, 6)
    samples = sampled(tokenizer, engine, **cut)
    worker = Worker("policy", model, pad_id=tokenizer.pad_token_id, **cut)
    fields = worker.forward_fields(samples, ("logprobs", "kept_logprobs"), [consecutive(len(samples), 3)])
    alone = worker.forward(samples, "logprobs", [[list(range(8))]])
    assert max((a - b).abs().max().item() for a, b in zip(fields["logprobs"], alone)) < 1e-5
    resp = [slice(len(s.prompt_ids) - 1, None) for s in samples]
    kept_err = max((k[r] - s.gen_logprobs[r]).abs().max().item() for k, s, r in zip(fields["kept_logprobs"], samples,
                                                                                      resp))
    full_err = max((k[r] - s.gen_logprobs[r]).abs().max().item() for k, s, r in zip(fields["logprobs"], samples, resp))
    assert kept_err < 1e-5 and full_err > 1e-2
