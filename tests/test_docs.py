"""The README's configuration reference lists every key, and the examples load."""

from __future__ import annotations

from pathlib import Path

import pytest

from exactrl.config import DemoConfig, PipelineConfig, RLConfig, SFTConfig, load_config
from exactrl.config.loader import valid_keys
from exactrl.config.schema_commands import EvalCommandConfig
from exactrl.config.schema_study import StudyConfig

ROOT = Path(__file__).resolve().parents[1]


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    keys = set(valid_keys(SFTConfig)) | set(valid_keys(RLConfig))
    keys |= {k for cls in (PipelineConfig, DemoConfig) for k in valid_keys(cls) if not k.startswith(("sft.", "rl."))}
    keys |= set(valid_keys(EvalCommandConfig))
    keys |= {k for k in valid_keys(StudyConfig) if not k.startswith(("sft.", "rl.", "mixed.", "task.", "base."))}
    missing = sorted(k for k in keys if f"`{k}`" not in readme)
    assert not missing, f"README configuration reference lacks: {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_configs(path):
    from exactrl.pipelines.plan import detect_command

    load_config({"sft": SFTConfig, "rl": RLConfig, "pipeline": PipelineConfig}[detect_command(path)], path)


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
