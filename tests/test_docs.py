"""The examples load (every config key is documented in docs/configuration.md: tests/test_reference.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exactrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_configs(path):
    from exactrl.cli import COMMANDS
    from exactrl.pipelines.plan import detect_command

    load_config(COMMANDS[detect_command(path)], path)


def test_every_algorithm_has_an_example_config_that_loads():
    """examples/<algo>.yaml for each algo.name (grpo's is grpo_tiny.yaml), valid as written."""
    from pathlib import Path

    from exactrl.config import RLConfig, SFTConfig, load_config
    from exactrl.config.methods import METHODS

    root = Path(__file__).resolve().parents[1] / "examples"
    for algo in METHODS:
        path = root / ("grpo_tiny.yaml" if algo == "grpo" else f"{algo}.yaml")
        assert load_config(RLConfig, path).algo.name == algo, path
    assert load_config(SFTConfig, root / "sft_tiny.yaml").model.path == "builtin"
