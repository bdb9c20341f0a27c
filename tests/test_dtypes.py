"""model.dtype's names mean one thing each (exactrl/dtypes.py): every choice the config offers has
its row, and what a row says is what the forwards, vLLM's arguments and the sync probe do."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch

from exactrl.checks.weight_sync import SyncCheck
from exactrl.config.schema import ModelConfig
from exactrl.config.schema_rl import RolloutConfig
from exactrl.dtypes import PRECISIONS, autocast_for


def test_every_model_dtype_has_a_row_and_no_row_is_unreachable():
    names = set(get_args(ModelConfig.model_fields["dtype"].annotation))
    assert names == set(PRECISIONS), f"model.dtype offers {sorted(names)}; exactrl/dtypes.py has {sorted(PRECISIONS)}"


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_a_row_is_what_the_forward_computes_in(name):
    """A matmul under the run's autocast comes out in the row's compute dtype (fp32 without one)."""
    p = PRECISIONS[name]
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast_for(name, torch.device("cpu")):
        out = a @ b
    assert out.dtype == (p.autocast or torch.float32)


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_vllm_is_told_the_dtype_the_weights_are_sent_in(name):
    """vLLM's dtype argument takes torch's names: the engine must compute in what it is sent."""
    p = PRECISIONS[name]
    assert getattr(torch, p.vllm) is p.weights


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_the_probe_tolerance_is_the_rows_and_the_config_says_so(name):
    assert SyncCheck(dtype=name).tol == PRECISIONS[name].probe_tol
    assert SyncCheck(dtype=name, probe_tol=0.5).tol == 0.5
    # rollout.probe_tol's description (the config reference is generated from it) states the defaults
    stated = re.search(rf"\b{name} ([0-9.e-]+)", RolloutConfig.model_fields["probe_tol"].description)
    assert stated and float(stated[1].rstrip(".")) == PRECISIONS[name].probe_tol
