"""Offline KD's (`exactrl kd`) test samples and its one-pass reference, written from each divergence's formula with
plain torch (padded forwards of both models, one sum over every loss token divided by their count: no exactrl loss,
term, plan or aggregation code): shared by tests/test_kd.py (one process) and kd_layouts.py (FSDP2 and DeepSpeed at
world size 2).

Ten SFT samples whose completions run from 1 to ~60 tokens, so micro-batches and ranks hold very different numbers
of loss tokens: what a per-micro-batch mean gets wrong. The teacher is another random model of the same tokenizer
(seed 9), the student seed 3.
"""

from __future__ import annotations

import torch
from pair_references import ANSWERS, fresh_model, padded

from exactrl.data.batch import Sample

LR, ALPHA, T, BETA, K = 1.0, 0.6, 0.7, 0.3, 5
LOSSES = ("forward_kl", "reverse_kl", "jsd", "topk_forward_kl")


def make_samples(tok) -> list[Sample]:
    """Ten SFT samples (a pair's two answers each as a demonstration) of very different token counts."""
    out = []
    for i, (a, b) in enumerate(ANSWERS):
        for answer in (a, b):
            out.append(Sample(tok(f"{i}+{i * 7}=")["input_ids"], tok(answer, add_special_tokens=False)["input_ids"],
                              source="demonstration"))
    return out


def divergence_ref(loss: str, zt: torch.Tensor, zs: torch.Tensor) -> torch.Tensor:
    lt, ls = torch.log_softmax(zt / T, -1), torch.log_softmax(zs / T, -1)
    pt, ps = lt.exp(), ls.exp()
    if loss == "forward_kl":
        return (pt * (lt - ls)).sum(-1)
    if loss == "reverse_kl":
        return (ps * (ls - lt)).sum(-1)
    if loss == "jsd":
        m = BETA * pt + (1 - BETA) * ps
        return BETA * (pt * (lt - m.log())).sum(-1) + (1 - BETA) * (ps * (ls - m.log())).sum(-1)
    top, ids = lt.topk(K, -1)
    q = top.exp() / top.exp().sum(-1, keepdim=True)  # the teacher renormalised over its top K
    return (q * (q.log() - ls.gather(-1, ids))).sum(-1)


def reference_loss(student, teacher, samples, pad_id, loss, alpha=ALPHA):
    """(the step's loss, its mean divergence) over every loss token of ``samples``."""
    ids, attn = padded(samples, pad_id)
    zs = student(input_ids=ids, attention_mask=attn).logits[:, :-1]
    with torch.no_grad():
        zt = teacher(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = -torch.log_softmax(zs, -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.zeros_like(nll)
    for b, s in enumerate(samples):
        mask[b, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)] = 1
    div = divergence_ref(loss, zt, zs)
    n = mask.sum()
    return (((1 - alpha) * nll + alpha * div) * mask).sum() / n, (div * mask).sum() / n


def sgd_reference(tok, samples, loss, teacher_seed=9):
    """(parameters after one plain SGD step on reference_loss, the step's loss, its mean divergence)."""
    student, teacher = fresh_model(tok), fresh_model(tok, seed=teacher_seed)
    value, div = reference_loss(student, teacher, samples, tok.pad_token_id, loss)
    value.backward()
    with torch.no_grad():
        for p in student.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in student.state_dict().items()}, value.item(), div.item()
