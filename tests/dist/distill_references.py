"""On-policy distillation's test samples and its one-pass reference, written from the sources' formulas with
plain torch (no exactrl loss, term, plan, aggregation or worker code): shared by tests/test_on_policy_distill.py
(one process) and distill_equivalence.py (FSDP2 at world size 1 and 2).

Seven student samples whose responses run from 1 to ~60 tokens, so micro-batches and ranks hold very different
numbers of policy tokens: what a per-micro-batch mean gets wrong. The teacher is another random model of the
same tokenizer (seed 9), the student seed 3.
"""

from __future__ import annotations

import torch
from equivalence import SMALL, in_dtype

from exactrl.data.batch import Sample
from exactrl.tasks.arithmetic import Problem, worked_solution
from exactrl.tasks.tiny_model import build_tiny_model

LOSSES = ("k1", "k3", "reverse_kl", "forward_kl_topk", "jsd")
BETA, TOPK = 0.3, 5
RESPONSES = ["#### 15", worked_solution(Problem(347, 285)), "1", "x" * 30, worked_solution(Problem(7, 8)), "ab",
             worked_solution(Problem(123456, 654321))]


def fresh_model(tok, seed: int = 3, dtype=torch.float64):
    return in_dtype(build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed,
                                     **SMALL), dtype)


def make_samples(tok) -> list[Sample]:
    """The student's samples: a prompt and a response each, loss on the response (source on_policy)."""
    return [Sample(tok(f"{i}+{i * 7}=")["input_ids"], tok(r, add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id]) for i, r in enumerate(RESPONSES)]


def response_logits(model, samples: list[Sample], pad_id: int) -> list[torch.Tensor]:
    """Each sample's logits predicting its response tokens [n, V], one padded forward."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs])
    attn = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    logits = model(input_ids=ids, attention_mask=attn).logits
    return [logits[b, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
            for b, s in enumerate(samples)]


def token_losses(loss: str, student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The per-token loss of ``loss`` from its source's formula: student/teacher logits [n, V] at the positions
    predicting ``targets`` [n] (the student's sampled tokens)."""
    ls, lt = student.log_softmax(-1), teacher.detach().log_softmax(-1)
    ps, pt = ls.exp(), lt.exp()
    s, t = ls.gather(-1, targets[:, None])[:, 0], lt.gather(-1, targets[:, None])[:, 0]
    if loss == "k1":  # Thinking Machines: advantage -(log p_S - log p_T), fixed; importance ratio p / p_old
        return (s.detach() - t) * torch.exp(s - s.detach())
    if loss == "k3":  # r - 1 - log r, r = p_T / p_S, differentiated through p_S
        return torch.exp(t - s) - 1 - (t - s)
    if loss == "reverse_kl":  # KL(p_S || p_T) over the vocabulary
        return (ps * (ls - lt)).sum(-1)
    if loss == "jsd":  # GKD eq. 1: beta KL(p_T || M) + (1 - beta) KL(p_S || M), M = beta p_T + (1 - beta) p_S
        m = BETA * pt + (1 - BETA) * ps
        return BETA * (pt * (lt - m.log())).sum(-1) + (1 - BETA) * (ps * (ls - m.log())).sum(-1)
    if loss == "forward_kl_topk":  # KL(p~_T || p_S) over the teacher's top-k, p~_T renormalised there
        top, ids = lt.topk(TOPK, dim=-1)
        q = top.exp() / top.exp().sum(-1, keepdim=True)
        return (q * (q.log() - ls.gather(-1, ids))).sum(-1)
    raise ValueError(loss)


def step_loss(model, teacher, samples: list[Sample], pad_id: int, loss: str, coef: float = 1.0) -> torch.Tensor:
    """The step's loss: coef x the sum of every response token's loss / the step's response tokens (token-mean)."""
    with torch.no_grad():
        teach = response_logits(teacher, samples, pad_id)
    per = [token_losses(loss, st, te, torch.tensor(s.response_ids)) for s, st, te in
           zip(samples, response_logits(model, samples, pad_id), teach)]
    return coef * torch.cat(per).sum() / sum(len(s.response_ids) for s in samples)


def sgd_reference(tok, samples: list[Sample], loss: str, lr: float, steps: int = 1) -> tuple[dict, dict, float]:
    """(parameters after ``steps`` plain SGD steps on step_loss, initial parameters, the first step's loss)."""
    model, teacher = fresh_model(tok), fresh_model(tok, seed=9)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    first = None
    for _ in range(steps):
        opt.zero_grad()
        value = step_loss(model, teacher, samples, tok.pad_token_id, loss)
        value.backward()
        opt.step()
        first = float(value.detach()) if first is None else first
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, init, first
