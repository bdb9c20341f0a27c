"""The typed batch: sequences with declared per-sequence and per-token fields.

A batch is a list of ``Sample`` rows. Per-token fields are declared once below (``per_token``),
each a tensor of length len(prompt + response) - 1 aligned with the next-token targets, and
per-sequence ones (``per_sequence``) one number per row; ``collate`` derives its keys from
these declarations. A sample has ONE loss mask (``loss_mask``): the step plan counts it and
collate pads it, so what is planned is what the loss sees. ``slots`` makes the declaration binding:
a field nobody declared cannot be set. ``source`` says where a sequence comes from, so loops
that mix data (on-policy rollouts with demonstrations, preference pairs) can tell them apart;
``origin`` says who wrote each of its tokens, for a sequence that mixes them (a demonstration's
prefix continued by the policy, as prefix-guided methods such as LUFFY train on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from exactrl.data.batching import pad_right

Source = Literal["on_policy", "demonstration", "chosen", "rejected"]
# Who wrote a token: the policy being trained, or a text it is shown (a demonstration, a
# preference pair's response), or, in a multi-turn episode, an environment's observation or the chat
# template's tokens around it (rollout/multiturn.py; never in the loss). A term of the objective may apply to
# the tokens of some origins.
ORIGINS = ("policy", "demonstration", "environment", "template")
SOURCE_ORIGIN = {"on_policy": "policy", "demonstration": "demonstration", "chosen": "demonstration",
                 "rejected": "demonstration"}  # the origin of every token of a row that declares none


def per_token(doc: str):
    """A declared per-token field (None until a pass computes it)."""
    return field(default=None, metadata={"per_token": True, "doc": doc})


def per_sequence(default, doc: str):
    """A declared per-sequence number (collated as a [B] tensor)."""
    return field(default=default, metadata={"per_sequence": True, "doc": doc})


@dataclass(slots=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float = per_sequence(0.0, "the weighted sum of the rewards, with any overlong shaping")
    finished: bool = per_sequence(True, "the model stopped by itself within rollout.max_new_tokens")
    parts: dict[str, float] = field(default_factory=dict)  # each reward.fn's own value
    penalty: float = per_sequence(0.0, "overlong shaping included in ``reward``")
    # a preference pair's own margin, the same on its two rows (data/preference.py; read by a reward model's
    # Bradley-Terry loss when asked, losses/pairs.py ScoreTerm): a column of the data, so declared here to be collated
    margin: float = per_sequence(0.0, "a preference pair's margin column (0 where the row has none)")
    # KTO's reference point of the row's micro-batch, set only under kto.z=micro_batch (the peers' form, to compare;
    # losses/kto.py): the default z is one number for the whole step, the KTO term's own
    kto_z: float = per_sequence(0.0, "KTO's per-micro-batch reference point (kto.z=micro_batch only)")
    source: Source = "on_policy"
    weights_version: int | None = None  # the generator's weights version that sampled it (on-policy)
    weights_digest: str | None = None  # the digest of those weights (exactrl/checks/weight_sync.py)
    # 1 on the targets the loss counts (num_targets long); None: every response token, no prompt token
    mask: tuple[int, ...] | None = None
    # who wrote each target, one of ORIGINS per target (num_targets long), for a row that mixes them (a
    # demonstration's prefix, then the policy's continuation); None: all are its source's (SOURCE_ORIGIN)
    origin: tuple[str, ...] | None = None
    # a multi-turn episode's policy turns (rollout/multiturn.py): each turn's [start, end) in targets, and the
    # reward its environment step gave (placed on the turn's last target by the advantage estimators)
    turn_spans: tuple[tuple[int, int], ...] | None = None
    turn_rewards: tuple[float, ...] | None = None
    advantages: torch.Tensor | None = per_token("zero on prompt targets")
    old_logprobs: torch.Tensor | None = per_token("the policy's before the rollout's first update, fixed for the "
                                                  "rollout")
    gen_logprobs: torch.Tensor | None = per_token("the generator's at sampling time, zero on prompt targets")
    old_kept_logprobs: torch.Tensor | None = per_token("old_logprobs over the top-p/top-k kept set, when the "
                                                       "generator's log-probs are (losses/rollout_gap.py)")
    ref_logprobs: torch.Tensor | None = per_token("the frozen reference's")
    old_values: torch.Tensor | None = per_token("the critic's before the rollout's first update (ppo)")
    returns: torch.Tensor | None = per_token("the critic's targets (ppo)")
    # a distillation teacher's, on the student's tokens (algorithms/distill.py; losses/distill_terms.py)
    teacher_logprobs: torch.Tensor | None = per_token("the teacher's log-prob of each target token")
    teacher_logits: torch.Tensor | None = per_token("[targets, vocabulary] the teacher's logits (distill.loss="
                                                    "reverse_kl, jsd)")
    teacher_topk_logprobs: torch.Tensor | None = per_token("[targets, k] the teacher's k largest log-probs "
                                                           "(distill.loss=forward_kl_topk)")
    teacher_topk_ids: torch.Tensor | None = per_token("[targets, k] their token ids")
    # a step-labelled row's labels (data/steps.py StepExample.sample; read by losses/process.py ProcessTerm)
    step_labels: torch.Tensor | None = per_token("1 (correct) or 0 (wrong) at each step's separator target, 0 "
                                                 "elsewhere (a process reward model's)")

    @property
    def ids(self) -> list[int]:
        """Prompt and response, the sequence every forward sees."""
        return self.prompt_ids + self.response_ids

    @property
    def num_targets(self) -> int:
        """Length of every per-token field: one per next-token target."""
        return len(self.prompt_ids) + len(self.response_ids) - 1

    @property
    def loss_mask(self) -> tuple[int, ...]:
        """1 on the next-token targets the loss counts: the one mask the plan and collate read."""
        if self.mask is not None:
            return self.mask
        return (0,) * (len(self.prompt_ids) - 1) + (1,) * len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def token_origins(self) -> tuple[str, ...]:
        """Each target's origin: the declared ``origin``, else the source's for every target."""
        if self.origin is None:
            return (SOURCE_ORIGIN[self.source],) * self.num_targets
        unknown = sorted(set(self.origin) - set(ORIGINS))
        if len(self.origin) != self.num_targets or unknown:
            raise ValueError(f"a sample's origin names one of {', '.join(ORIGINS)} per target ({self.num_targets} of "
                             f"them); got {len(self.origin)}" + (f", with {unknown}" if unknown else ""))
        return self.origin

    @property
    def origin_tokens(self) -> dict[str, int]:
        """Loss tokens by origin (in ORIGINS order, only origins that have some): what the plan counts."""
        if self.origin is None:
            return {SOURCE_ORIGIN[self.source]: self.loss_tokens} if self.loss_tokens else {}
        counts = dict.fromkeys(ORIGINS, 0)
        for o, m in zip(self.token_origins, self.loss_mask):
            counts[o] += m
        return {o: n for o, n in counts.items() if n}


TOKEN_FIELDS = tuple(f.name for f in fields(Sample) if f.metadata.get("per_token"))
SEQUENCE_FIELDS = tuple(f.name for f in fields(Sample) if f.metadata.get("per_sequence"))


def _origin_positions(s: Sample) -> list[int]:
    """Each target's origin as its position in ORIGINS (a row declaring none: one position, repeated)."""
    if s.origin is None:
        return [ORIGINS.index(SOURCE_ORIGIN[s.source])] * s.num_targets
    return [ORIGINS.index(o) for o in s.token_origins]


def collate(samples: list[Sample], pad_id: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Prompt+response sequences, right-padded. ``loss_mask`` [B, L-1] is each sample's own
    ``loss_mask``, ``origin`` [B, L-1] its ``token_origins`` as positions in ORIGINS; every
    declared per-token field set on all samples is padded to the same width (one set on only
    some is refused: a loss would read the missing rows as absent), every per-sequence field is
    a [B] tensor. On ``device`` (the model's), else the CPU."""
    seqs = [s.ids for s in samples]
    ids = pad_right(seqs, pad_id)
    attn = pad_right([[1] * len(s) for s in seqs], 0)
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": pad_right([list(s.loss_mask) for s in samples], 0),
           "origin": pad_right([_origin_positions(s) for s in samples], 0)}
    width = ids.size(1) - 1
    for key in TOKEN_FIELDS:
        values = [getattr(s, key) for s in samples]
        unset = [i for i, v in enumerate(values) if v is None]
        if len(unset) == len(values):
            continue
        if unset:
            raise ValueError(f"per-token field '{key}' is set on {len(values) - len(unset)} of the {len(values)} "
                             f"samples of a micro-batch (unset at rows {unset[:8]}): compute it for every sample or "
                             "for none")
        # padded along the targets (a field of [targets, k] keeps its k)
        out[key] = torch.stack([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, width - v.size(0)))
                                for v in values])
    for key in SEQUENCE_FIELDS:
        out[key] = torch.tensor([float(getattr(s, key)) for s in samples], dtype=torch.float64)
    return out if device is None else {k: v.to(device) for k, v in out.items()}
