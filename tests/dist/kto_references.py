"""Unpaired rows for KTO's tests (tests/test_kto.py in one process, kto_equivalence.py at world size 1 and 2) and
the one-pass references written from the KTO paper (Ethayarajh et al. 2024, arXiv 2402.01306, eq. 8) and TRL's
KL rows, with plain torch: no exactrl loss, term, plan, worker or aggregation code.

Nine rows (an odd number: ranks of 5 and 4 rows at world size 2) whose completions run from 1 to 66 tokens, labels
in no regular order, and a reference model whose KL gaps to the policy make z positive over the step and differ
from micro-batch to micro-batch.
"""

from __future__ import annotations

import torch
from pair_references import ANSWERS, answer_logprobs, fresh_model

from exactrl.data.batch import Sample
from exactrl.data.preference import UnpairedExample

BETA, W_D, W_U = 0.5, 1.0, 1.3
ORDER = [0, 3, 1, 2, 5, 4, 6, 9, 7]  # of the pairs' answers flattened (even: chosen): labels T F F T F T T F F


def reference_model(tok, dtype=torch.float64):
    """The frozen reference: another tiny model (its KL gaps to the policy's start average 0.44 over the step's KL
    rows, and range from below 0, clamped, to 1.7 over micro-batches of two rows)."""
    return fresh_model(tok, seed=9, dtype=dtype)


def make_rows(tok) -> list[Sample]:
    """The nine rows as samples (source "chosen" for a desirable completion, "rejected" for an undesirable one)."""
    flat = [(i, a, side == 0) for i, pair in enumerate(ANSWERS) for side, a in enumerate(pair)]
    rows = []
    for k in ORDER:
        i, answer, good = flat[k]
        rows.append(UnpairedExample(tok(f"{i}+{i * 7}=")["input_ids"], tok(answer, add_special_tokens=False)
                                    ["input_ids"], good, f"rows:{k + 1}").sample())
    return rows


def sums(model, samples: list[Sample], pad_id: int) -> torch.Tensor:
    """Each sample's completion log-prob summed over its tokens [N]."""
    return torch.stack([x.sum() for x in answer_logprobs(model, samples, pad_id)])


@torch.no_grad()
def paper_z(model, ref, rows: list[Sample], pad_id: int, steps: list[list[list[int]]]) -> torch.Tensor:
    """z of each row. ``steps``: the step's accumulation steps, each the rows (indices) of every rank's micro-batch
    then; within a micro-batch the KL rows are TRL's: row k's prompt with row k-1's completion (the first with the
    last's), and z = max(0, mean over ranks of the micro-batch mean of policy - reference). One accumulation step
    of one micro-batch holding every row is the step's z."""
    z = torch.zeros(len(rows), dtype=torch.float64)
    for ranks in steps:
        means = []
        for mb in ranks:
            kl = [Sample(rows[i].prompt_ids, rows[mb[k - 1]].response_ids) for k, i in enumerate(mb)]
            means.append((sums(model, kl, pad_id) - sums(ref, kl, pad_id)).mean())
        z[[i for mb in ranks for i in mb]] = torch.stack(means).mean().clamp(min=0)
    return z


def paper_loss(model, ref, rows: list[Sample], pad_id: int, z: torch.Tensor) -> torch.Tensor:
    """The mean over the step's rows of KTO's loss: r = log pi(y|x) - log pi_ref(y|x); desirable rows
    w_d (1 - sigma(beta (r - z))), undesirable ones w_u (1 - sigma(beta (z - r)))."""
    with torch.no_grad():
        ref_sums = sums(ref, rows, pad_id)
    r = sums(model, rows, pad_id) - ref_sums
    good = torch.tensor([s.source == "chosen" for s in rows])
    loss = torch.where(good, W_D * (1 - torch.sigmoid(BETA * (r - z))), W_U * (1 - torch.sigmoid(BETA * (z - r))))
    return loss.mean()


def sgd_reference(rows: list[Sample], tok, lr: float, steps: int, z_steps=None) -> tuple[dict, dict]:
    """Parameters after ``steps`` plain-torch SGD steps on KTO's loss, z recomputed from the current policy before
    each (``z_steps`` as paper_z takes them; None: the whole step's), and the initial parameters."""
    model, ref, pad = fresh_model(tok), reference_model(tok), tok.pad_token_id
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        z = paper_z(model, ref, rows, pad, z_steps or [[list(range(len(rows)))]])
        opt.zero_grad()
        paper_loss(model, ref, rows, pad, z).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, fresh_model(tok).state_dict()
