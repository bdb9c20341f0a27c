"""Where a run stands after a step (exactrl/algorithms/resume.py): every field of SFTPosition and
RLPosition goes into a checkpoint and comes back out of it, under the keys checkpoints have always
had, and a checkpoint from before a field was kept still resumes. The bitwise resume itself:
tests/test_resume.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import pytest
import torch

from exactrl.algorithms.resume import RLPosition, SFTPosition, since
from exactrl.distributed.checkpoint import CheckpointError


@dataclass
class WithANewField(RLPosition):
    """A field added later: state() and load() carry it with no more code, older checkpoints resume with 7."""

    new_counter: int = since(7)


POSITIONS = [SFTPosition, RLPosition, WithANewField]


def distinct_values(cls) -> dict:
    """A value per field that is no field's default and no other field's value."""
    return {f.name: ("saved", f.name, i) for i, f in enumerate(fields(cls))}


@pytest.mark.parametrize("cls", POSITIONS, ids=lambda c: c.__name__)
def test_every_field_is_saved_and_loaded(cls):
    values = distinct_values(cls)
    state = cls(**values).state()
    assert set(state) == set(values)
    back = cls.load(state)
    assert {f.name: getattr(back, f.name) for f in fields(cls)} == values


@pytest.mark.parametrize("cls", POSITIONS, ids=lambda c: c.__name__)
def test_a_field_a_checkpoint_lacks_is_its_since_value_or_a_clear_error(cls):
    values = distinct_values(cls)
    for f in fields(cls):
        state = {k: v for k, v in cls(**values).state().items() if k != f.name}
        if "since" in f.metadata:
            assert getattr(cls.load(state), f.name) == f.metadata["since"]
        else:
            with pytest.raises(CheckpointError, match=f"lacks '{f.name}'"):
                cls.load(state)


def test_the_keys_on_disk_are_the_ones_checkpoints_have_always_had():
    """Changing them strands every checkpoint written before: a new field needs ``since``."""
    assert [f.name for f in fields(SFTPosition)] == ["step", "flops_trained_tokens", "flops_generated_tokens"]
    assert [f.name for f in fields(RLPosition)] == ["step", "flops_trained_tokens", "flops_generated_tokens",
                                                    "rollout", "group_rng", "kl_coef", "sft_buffer"]


def test_an_rl_checkpoint_from_before_kl_coef_and_flops_were_kept_resumes(tmp_path):
    """A real state through torch.save and load(weights_only=True), as a checkpoint holds it."""
    rng = random.Random("seed-minibatches")
    rng.random()
    old = {"step": 6, "rollout": 2, "group_rng": rng.getstate(), "sft_buffer": [4, 1]}
    torch.save({"extra": old}, tmp_path / "state.pt")
    position = RLPosition.load(torch.load(tmp_path / "state.pt", weights_only=True)["extra"])
    assert (position.step, position.rollout, position.sft_buffer, position.kl_coef) == (6, 2, [4, 1], None)
    assert (position.flops_trained_tokens, position.flops_generated_tokens) == (0, 0)
    again = random.Random()
    again.setstate(position.group_rng)
    assert again.random() == rng.random()
