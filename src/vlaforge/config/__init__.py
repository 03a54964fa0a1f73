"""Typed, validated configuration: the single source of truth for a run."""

from vlaforge.config.loading import dump_toml, load_config, parse_overrides
from vlaforge.config.schema import ComponentConfig, VLAConfig

__all__ = ["ComponentConfig", "VLAConfig", "dump_toml", "load_config", "parse_overrides"]
