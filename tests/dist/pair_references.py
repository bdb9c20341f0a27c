"""Preference pairs for the pair objective's tests (tests/test_pair_objective.py in one process,
pair_equivalence.py at world size 1 and 2), and the one-pass references written from the papers' formulas
with plain torch: no exactrl loss, term, plan or aggregation code.

Five pairs whose answers run from 1 to ~60 tokens, so micro-batches of 2 + 2 + 1 pairs (or ranks of 3 and 2)
carry very different numbers of pairs and tokens: what a per-micro-batch mean over pairs gets wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from equivalence import SMALL, in_dtype

from exactrl.data.batch import Sample
from exactrl.data.preference import PairExample
from exactrl.tasks.arithmetic import Problem, worked_solution
from exactrl.tasks.tiny_model import build_tiny_model

BETA, NLL_COEF = 0.5, 0.3
# (chosen, rejected) answers of each pair
ANSWERS = [("#### 15", "1"), (worked_solution(Problem(347, 285)), "#### 632"), ("2", "x" * 30),
           ("#### 10", worked_solution(Problem(7, 8))), ("ab", worked_solution(Problem(123456, 654321)))]


def fresh_model(tok, seed: int = 3, dtype=torch.float64):
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SMALL)
    return in_dtype(model, dtype)


def padded(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    return (torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs]),
            torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]))


def answer_logprobs(model, samples: list[Sample], pad_id: int) -> list[torch.Tensor]:
    """Each sample's per-token log-probs of its answer's tokens (one padded forward)."""
    ids, attn = padded(samples, pad_id)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return [logp[b, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
            for b, s in enumerate(samples)]


@torch.no_grad()
def make_pairs(tok, dtype=torch.float64) -> list[Sample]:
    """The five pairs as samples, chosen then rejected, each with a reference model's log-probs (ref_logprobs)."""
    samples = []
    for i, (chosen, rejected) in enumerate(ANSWERS):
        answers = [tok(a, add_special_tokens=False)["input_ids"] for a in (chosen, rejected)]
        samples += PairExample(tok(f"{i}+{i * 7}=")["input_ids"], *answers, f"pairs:{i + 1}").samples()
    ref, ids = fresh_model(tok, seed=9, dtype=dtype), padded(samples, tok.pad_token_id)[0]
    for s, lp in zip(samples, answer_logprobs(ref, samples, tok.pad_token_id)):
        # per target (num_targets long): 0 on the prompt's targets, as a reference forward leaves them unread
        s.ref_logprobs = torch.cat([torch.zeros(len(s.prompt_ids) - 1, dtype=dtype), lp])
    assert ids.size(0) == 10
    return samples


def dpo_per_pair(model, samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's DPO loss of each pair (Rafailov et al. 2023, eq. 7), -log sigmoid(beta ((log pi(y_w) -
    log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)))), and the chosen answers' token NLL sums and counts."""
    lp = answer_logprobs(model, samples, pad_id)
    sums = torch.stack([x.sum() for x in lp])
    ref = torch.stack([s.ref_logprobs[len(s.prompt_ids) - 1 :].sum() for s in samples])
    logits = (sums[0::2] - ref[0::2]) - (sums[1::2] - ref[1::2])
    nll = torch.stack([-x.sum() for x in lp[0::2]])
    tokens = torch.tensor([len(s.response_ids) for s in samples[0::2]], dtype=sums.dtype)
    return -F.logsigmoid(BETA * logits), torch.stack([nll, tokens])


@torch.no_grad()
def rewards(model, samples: list[Sample], pad_id: int) -> torch.Tensor:
    """DPO's implicit rewards beta (log pi(y) - log pi_ref(y)) of each pair's chosen and rejected answer [2, P]."""
    sums = torch.stack([x.sum() for x in answer_logprobs(model, samples, pad_id)])
    ref = torch.stack([s.ref_logprobs[len(s.prompt_ids) - 1 :].sum() for s in samples])
    return BETA * (sums - ref).view(-1, 2).T


def reference_loss(model, samples: list[Sample], pad_id: int, nll_coef: float = 0.0) -> torch.Tensor:
    """The step's mean over its pairs of the DPO loss, plus ``nll_coef`` x the chosen answers' token-mean NLL
    (RPO, Pang et al. 2024, arXiv 2404.19733, with the token mean TRL's rpo_alpha takes)."""
    dpo, (nll, tokens) = dpo_per_pair(model, samples, pad_id)
    return dpo.mean() + nll_coef * nll.sum() / tokens.sum()


def peers_loss(model, samples: list[Sample], pad_id: int, micro_batches: list[list[int]]) -> torch.Tensor:
    """TRL's and OpenRLHF's DPO step: each micro-batch's mean over its own pairs, divided by the number of
    micro-batches of the step (all ranks). ``micro_batches``: the pairs (indices) of each."""
    dpo, _ = dpo_per_pair(model, samples, pad_id)
    return sum(dpo[list(mb)].mean() for mb in micro_batches) / len(micro_batches)


def sgd_reference(samples: list[Sample], tok, lr: float, steps: int, nll_coef: float = 0.0) -> tuple[dict, dict]:
    """Parameters after ``steps`` plain-torch SGD steps on the reference loss, and the initial ones."""
    model = fresh_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        reference_loss(model, samples, tok.pad_token_id, nll_coef).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, fresh_model(tok).state_dict()
