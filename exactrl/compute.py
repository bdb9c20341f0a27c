"""Compute accounting: the FLOPs model of the seed paper (arXiv 2604.23747, Appendix B).

A forward pass of a model with N parameters over D tokens costs about 2*N*D FLOPs and a backward
pass about 4*N*D (Kaplan et al. 2020; Hoffmann et al. 2022), so

- training on a sequence costs 6*N*D (forward + backward);
- generating it costs 2*N*D (the inference engine's forward, prompt prefill included);
- an on-policy RL rollout is generated once and trained on once: 8*N*D;
- an off-policy demonstration inside an RL step (``Sample.source == "demonstration"``) is only
  trained on: 6*N*D, as an SFT sample.

N is every parameter of the trained model (embeddings included, a tied head once). A run counts D
as the tokens of each whole sequence it processed (prompt + response); the paper's Appendix B counts
response tokens only ("including prompt tokens would scale all values proportionally"), so the plan
functions below take whatever tokens per sample the caller states, and the paper's totals come out
of them with its own figures (tests/test_compute.py).

What the model leaves out, and exactrl does not count separately either: the no-grad forwards of
old and reference log-probs (2*N*D each when taken: PPO epochs > 1, a KL term), the critic of ppo
(its own N), evaluation and the self-checks' decoding, the optimizer step, and the backward's
saving under LoRA (frozen weights get no weight gradient; counted at the full 6*N*D). Each further
PPO epoch over a rollout is another training pass, counted (6*N*D more).

One no-grad forward is counted: offline distillation's teacher (`exactrl kd`), which scores every trained
sequence once, 2*N_teacher*D, with the teacher's own N. Unlike a reference (the policy's own size, and often
cached), a teacher may be many times the student's size and then costs more than the student's training.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TRAIN_PER_PARAM_TOKEN = 6  # forward 2ND + backward 4ND
GENERATE_PER_PARAM_TOKEN = 2  # one forward per token


def count_parameters(model) -> int:
    """N: every parameter once (a tied head is one tensor; ZeRO-3 partitions report their full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def sft_flops(n_params: float, samples: float, tokens_per_sample: float) -> float:
    """SFT over ``samples`` sequences (epochs x dataset size) of ``tokens_per_sample`` tokens: 6*N*D each."""
    return TRAIN_PER_PARAM_TOKEN * n_params * samples * tokens_per_sample


def kd_flops(n_student: float, n_teacher: float, samples: float, tokens_per_sample: float) -> float:
    """Offline distillation over ``samples`` sequences: the student trained on each (6*N_student*D), the
    teacher's forward over the same tokens without a backward (2*N_teacher*D)."""
    return (sft_flops(n_student, samples, tokens_per_sample)
            + GENERATE_PER_PARAM_TOKEN * n_teacher * samples * tokens_per_sample)


def rl_flops(n_params: float, rollouts: float, prompts_per_rollout: float, on_policy_per_prompt: float,
             rollout_tokens: float, demonstrations_per_prompt: float = 0, demonstration_tokens: float = 0,
             training_passes: int = 1) -> float:
    """RL over ``rollouts`` rollouts (the papers' "RL steps") of ``prompts_per_rollout`` prompts, each with
    ``on_policy_per_prompt`` generated responses of ``rollout_tokens`` tokens (2*N*D to generate, 6*N*D per
    training pass) and ``demonstrations_per_prompt`` demonstrations of ``demonstration_tokens`` (6*N*D per
    pass). ``training_passes``: algo.ppo_epochs (each pass trains every sample of the rollout once)."""
    generated = on_policy_per_prompt * rollout_tokens
    trained = generated + demonstrations_per_prompt * demonstration_tokens
    per_prompt = GENERATE_PER_PARAM_TOKEN * generated + TRAIN_PER_PARAM_TOKEN * training_passes * trained
    return n_params * rollouts * prompts_per_rollout * per_prompt


def _forwarded(s) -> int:
    """Tokens the generator ran through the model for ``s``: its prompt and response once; for an episode
    (rollout/multiturn.py), each turn's request, the episode so far and the turn's own tokens (every turn is its
    own request, prefilled again)."""
    if s.turn_spans is None:
        return len(s.ids)
    return sum(b + 1 for _, b in s.turn_spans)


@dataclass
class FlopsCounter:
    """What one phase processed, counted as it goes; ``record()`` is what metrics.jsonl and summary.json
    carry (cumulative from the phase's first step, a resumed run included)."""

    n_params: int
    trained_tokens: int = 0
    generated_tokens: int = 0
    teacher_params: int = 0  # kd's teacher: a no-grad forward over every trained token, 2*N_teacher*D

    def generated(self, samples: list, responses_generated: int | None = None) -> None:
        """A rollout's samples: every one the generator wrote (all but demonstrations) costs 2*N*D.
        ``responses_generated``: the response tokens generated in all, when that is more than the samples
        kept (DAPO drops groups and samples again): the dropped responses count too, their prompts' prefill
        does not (the rollout's statistics do not carry it)."""
        made = [s for s in samples if s.source != "demonstration"]
        dropped = 0 if responses_generated is None else responses_generated - sum(len(s.response_ids) for s in made)
        self.generated_tokens += sum(_forwarded(s) for s in made) + max(0, dropped)

    def trained(self, samples: Iterable) -> None:
        """One optimizer step's global batch (all ranks): 6*N*D per sample."""
        self.trained_tokens += sum(len(s.ids) for s in samples)

    @property
    def flops(self) -> float:
        return float(self.n_params * (TRAIN_PER_PARAM_TOKEN * self.trained_tokens
                                      + GENERATE_PER_PARAM_TOKEN * self.generated_tokens)
                     + self.teacher_params * GENERATE_PER_PARAM_TOKEN * self.trained_tokens)

    def record(self) -> dict:
        teacher = {"teacher_n_params": self.teacher_params} if self.teacher_params else {}
        return {"flops": self.flops, "flops_trained_tokens": self.trained_tokens,
                "flops_generated_tokens": self.generated_tokens, "n_params": self.n_params, **teacher}

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run's counts continue."""
        return {"flops_trained_tokens": self.trained_tokens, "flops_generated_tokens": self.generated_tokens}

    def load(self, position: dict) -> None:
        self.trained_tokens = position.get("flops_trained_tokens", 0)
        self.generated_tokens = position.get("flops_generated_tokens", 0)
