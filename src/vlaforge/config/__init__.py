"""Configuration, floor 2 (imports `data` and below): the pydantic classes that are the single source of truth
for a run, TOML recipes and `--a.b=v` overrides, the model flavors (plain data), and the model shapes an "auto"
recipe takes from a dataset (`shapes.py`)."""

from vlaforge.config.loading import dump_toml, load_config, parse_overrides
from vlaforge.config.schema import ComponentConfig, VLAConfig

__all__ = ["ComponentConfig", "VLAConfig", "dump_toml", "load_config", "parse_overrides"]
