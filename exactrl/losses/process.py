"""A process reward model's loss: per-step binary classification at the step separators (Lightman et al. 2023,
"Let's Verify Step by Step", arXiv 2305.20050; TRL's PRMTrainer; OpenRLHF's former PRM).

A step-labelled row is one sample whose loss targets are exactly its steps' (data/steps.py StepExample.sample):
at each step's separator's last token the scalar head's output s (a logit, the reward model's per-token field
"scores") is scored against the step's label y in {0, 1} with the binary cross-entropy

    l(s, y) = -(y log sigma(s) + (1 - y) log(1 - sigma(s))) = softplus(s) - y s,

and the step loss is the sum of l over **every labelled step of the optimizer step** (all micro-batches, all ranks)
divided by their number: the term aggregates "token-mean" over its loss targets, and a PRM sample's loss targets
are its steps, so the plan's step-wide count of loss targets (distributed/step_plan.py, before the first backward)
is the step's number of labelled steps. The update is then the same for any micro-batch size, world size or way
the steps fall in rows. TRL's PRMTrainer (token classification, cross-entropy with ignore_index) and OpenRLHF's
PRMLoss (CrossEntropyLoss over the placeholder positions) take a mean over each micro-batch's steps, then divide by
the accumulation steps: exact only when every micro-batch holds as many steps (fault.mean_of_means reproduces it).
TRL's two-class head gives the same loss with s = z_1 - z_0: softmax over (z_0, z_1) is sigma(z_1 - z_0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exactrl.losses.objective import Term


def step_bce(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The binary cross-entropy of each logit ``scores`` against its label (1 correct, 0 wrong), unreduced."""
    return F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype), reduction="none")


@dataclass(frozen=True, kw_only=True)
class ProcessTerm(Term):
    """The PRM's per-step loss on the reward model's ``scores`` at the targets of the samples' loss mask (their
    steps), labels from the samples' ``step_labels``; normalised by ``agg`` over the step's loss targets (token-mean:
    all labelled steps of the step). Metric: step_accuracy, the share of the step's steps whose sign of s is the
    label (s > 0: correct)."""

    kind = "process"
    fields: tuple[str, ...] = ("scores",)

    def token_loss(self, f, b, mask, m):
        if "step_labels" not in b:
            raise ValueError("a process reward model's term reads each step's label (step_labels): build its samples "
                             "with data/steps.py StepExample.sample()")
        scores, labels = f["scores"], b["step_labels"]
        with torch.no_grad():
            m.mean("step_accuracy", ((scores > 0) == (labels > 0.5)).double(), mask)
        return step_bce(scores, labels)
