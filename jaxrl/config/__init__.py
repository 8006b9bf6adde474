"""Typed jaxrl config: schema (dataclasses), loader (YAML + ``key=value`` overrides), verl compat notes.

Importing this package never imports jax.
"""

from jaxrl.config.compat import CompatNote
from jaxrl.config.loader import (
    ConfigError,
    LoadedConfig,
    config_to_dict,
    config_to_yaml,
    load_config,
    load_config_with_notes,
)
from jaxrl.config.schema import JaxRLConfig, valid_keys

__all__ = [
    "CompatNote",
    "ConfigError",
    "JaxRLConfig",
    "LoadedConfig",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "load_config_with_notes",
    "valid_keys",
]
