"""Typed configs (schema.py) and their loading from YAML + dotted overrides (loader.py)."""

from exactrl.config.loader import ConfigError, dump_config, load_config
from exactrl.config.schema import SFTConfig
from exactrl.config.schema_commands import DemoConfig, PipelineConfig
from exactrl.config.schema_rl import RLConfig

__all__ = ["ConfigError", "DemoConfig", "PipelineConfig", "RLConfig", "SFTConfig", "dump_config", "load_config"]
