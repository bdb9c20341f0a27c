"""Step-labelled rows for the process reward model's tests (tests/test_prm.py in one process, prm_equivalence.py at
world size 1 and 2), and the one-pass reference written from the formula with plain torch: each row run alone, the
head read at each separator's last token, the binary cross-entropy written out, averaged over every labelled step of
the step (Lightman et al. 2023; TRL's PRMTrainer scores the same token). No exactrl loss, term, plan or aggregation.

Six rows holding 1 to 6 steps of 6 to 30 characters, in an order where micro-batches of 2 rows hold 6, 8 and 4 steps
(world size 2, micro-batches of 1 row: ranks of 3 rows holding 9 and 9 steps, in micro-batches of 1 to 6).
"""

from __future__ import annotations

import tempfile

import torch
from equivalence import SMALL, in_dtype

from exactrl.data.jsonl import Row
from exactrl.data.steps import StepExample, encode_steps
from exactrl.models.loading import load_value_model
from exactrl.tasks.tiny_model import build_tiny_model

SEP = " ;"  # two tokens: the score is read at the second
T, F = True, False
ROWS = [
    {"prompt": "7+8=", "completions": ["#### 16"], "labels": [F]},
    {"prompt": "999+1=", "completions": ["9+1+0=10", "9+0+1=10", "9+0+1=11", "0+0+1=01", "#### 1100"],
     "labels": [T, T, F, T, F]},
    {"prompt": "5+5=", "completions": ["5+5+0=10", "#### 10"], "labels": [T, T]},
    {"prompt": "123+456=", "completions": ["3+6+0=09", "2+5+0=07", "1+4+0=05", "so the sum is", "x" * 30, "#### 579"],
     "labels": [T, T, T, T, F, T]},
    {"prompt": "1+1=", "completions": ["#### 2"], "labels": [T]},
    {"prompt": "12+34=", "completions": ["2+4+0=06", "1+3+0=04", "#### 46"], "labels": [T, F, F]},
]
_LM: dict[int, str] = {}  # the causal LM's directory, saved once per process


def make_steps(tok) -> list[StepExample]:
    return encode_steps([Row(f"steps.jsonl:{i + 1}", r) for i, r in enumerate(ROWS)], tok, 256, separator=SEP)


def value_model(tok, dtype=torch.float64, seed: int = 3):
    """A tiny value model (the causal LM of ``seed`` with a scalar head, as `exactrl rm` builds one), its head made
    large enough that the step logits spread over O(1): the loss is far from ln 2 and both labels' terms matter."""
    if seed not in _LM:
        _LM[seed] = tempfile.mkdtemp(prefix="prm-lm-")
        build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed,
                         **SMALL).save_pretrained(_LM[seed])
    model = in_dtype(load_value_model(_LM[seed], init_seed=7), dtype)
    with torch.no_grad():
        model.score.weight.mul_(30.0)
    return model


def step_logits(model, e: StepExample) -> torch.Tensor:
    """The head at each step's separator's last token, the row run alone (no padding, no packing)."""
    return model(input_ids=torch.tensor([e.input_ids])).logits[0, e.positions, 0]


def bce(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """-(y log sigma(s) + (1 - y) log(1 - sigma(s))), written out."""
    p = 1 / (1 + torch.exp(-s))
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))


def reference_loss(model, examples: list[StepExample], groups: list[list[int]] | None = None) -> torch.Tensor:
    """The mean of the step loss over every labelled step of ``examples``; with ``groups`` (lists of row indices, the
    micro-batches) the peers' form instead: each group's mean over its own steps, summed, divided by the groups."""
    per_row = [bce(step_logits(model, e), torch.tensor(e.labels, dtype=torch.float64)) for e in examples]
    if groups is None:
        return torch.cat(per_row).mean()
    return sum(torch.cat([per_row[i] for i in g]).mean() for g in groups) / len(groups)


def sgd_reference(tok, examples, lr: float, steps: int, groups=None) -> tuple[dict, dict]:
    """(parameters after ``steps`` plain SGD steps on reference_loss, the initial parameters)."""
    model = value_model(tok)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for _ in range(steps):
        model.zero_grad()
        reference_loss(model, examples, groups).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, init
