"""`exactrl dpo` end to end on the built-in task's pairs: the reference path, the pair unit and the
step's normaliser through the path a user's run takes (the losses' maths: test_preference_losses.py;
the pair unit's exactness under every split and layout: test_pair_objective.py)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from exactrl.algorithms.dpo import dpo_objective, train_dpo
from exactrl.config import load_config
from exactrl.config.loader import ConfigError
from exactrl.config.schema_pref import DPOConfig
from exactrl.tasks.builtin import BuiltinSpec

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
COMMON = ["model.path=builtin", "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.max_steps=2", "train.log_every=1", "optim.lr=1e-3"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"step"' in line and '"loss"' in line]


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_first_step_is_the_loss_at_a_zero_log_ratio(tmp_path, loss):
    """At step 1 the policy is its reference, so every pair's log-ratios are 0: DPO's loss is
    -log sigmoid(0) = ln 2 and IPO's (0 - 1/(2 beta))^2, for the step's mean over its pairs whatever
    the split (4 micro-batches of 2 pairs here). A sum over pairs, a missing reference or a reference
    that is not the policy's starting point would not give it. The canary reads exactly 1."""
    cfg = load_config(DPOConfig, None, [*COMMON, f"dpo.loss={loss}", f"output_dir={tmp_path / 'run'}"])
    result = train_dpo(cfg, spec=SPEC)
    first, second = _records(result.run_dir)[:2]
    beta = cfg.dpo.beta
    expected = math.log(2) if loss == "dpo" else (1 / (2 * beta)) ** 2
    assert first["loss"] == pytest.approx(expected, rel=1e-6)
    assert first["pairs"] == 8 and first["micro_batches"] == 4 and first["reward_margin"] == 0
    assert first["canary"] == 1.0 and second["canary"] == 1.0
    assert second["loss"] != first["loss"]  # the first step moved the policy away from its reference


def test_a_knob_the_loss_does_not_read_is_refused():
    cfg = load_config(DPOConfig, None, ["dpo.loss=dpo", "dpo.gamma=1.0"])
    with pytest.raises(ConfigError, match="dpo.gamma is set, but dpo.loss=dpo does not read it"):
        dpo_objective(cfg)
    assert [t.kind for t in dpo_objective(load_config(DPOConfig, None, ["dpo.loss=orpo"])).terms] == ["pair", "nll"]


def test_a_reference_free_loss_with_a_reference_exits_2(tmp_path):
    from exactrl.cli import app

    result = CliRunner().invoke(app, ["dpo", "dpo.loss=simpo", f"dpo.reference={tmp_path}",
                                      f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "reference-free" in result.output
