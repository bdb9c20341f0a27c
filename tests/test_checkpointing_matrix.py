"""Activation checkpointing on every architecture of the matrix, with the output head in chunks:
each decoder layer is recomputed in backward, and the gradients are those of the plain backward
(full logits, activations kept), packed where the model packs. Every family of the matrix supports
it; a class that does not (JetMoe) is refused in one line (tests/test_memory_knobs.py)."""

from __future__ import annotations

import pytest
import torch
import transformers.modeling_utils

from archs import ARCHS, build
from exactrl.distributed.engine import enable_gradient_checkpointing
from exactrl.models import packing
from test_arch_matrix import NO_PACKING
from test_chunked_head import chunked_fields, plain_fields, prepared, seqs, values_and_grads


@pytest.fixture
def checkpoints(monkeypatch):
    calls = []
    checkpoint = transformers.modeling_utils.checkpoint
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda fn, *a, **k: calls.append(1) or checkpoint(fn, *a, **k))
    return calls


@pytest.mark.parametrize("name", ARCHS)
def test_checkpointed_layers_and_the_chunked_head_give_the_plain_gradients(name, checkpoints):
    model = prepared(build(name))  # train mode: checkpointing acts only there (a random forward replays its draws)
    plain = model_grads(model, name, checkpointed=False)
    enable_gradient_checkpointing(model)
    checked = model_grads(model, name, checkpointed=True)
    layers = len(model.model.layers) if hasattr(model, "model") and hasattr(model.model, "layers") else 1
    assert len(checkpoints) >= layers  # every decoder layer recomputed (the plain run made none)
    assert plain.keys() == checked.keys()
    total = torch.cat([g.flatten() for g in plain.values()]).norm().item()
    for n in plain:
        assert (checked[n] - plain[n]).norm().item() <= 1e-5 * plain[n].norm().item() + 1e-7 * total, n


def model_grads(model, name, checkpointed: bool) -> dict:
    """Plain: the model's full logits; checkpointed: the head in chunks of 5 tokens."""
    packed = name not in NO_PACKING and packing.can_pack(model)
    mb = packing.model_batch(model, seqs(), 0, packed=packed)
    torch.manual_seed(0)  # a model whose training forward draws (PhiMoE's routing) draws the same in both runs
    fields = (lambda: chunked_fields(model, mb, 5)) if checkpointed else (lambda: plain_fields(model, mb))
    return values_and_grads(model, mb, fields)[1]
