"""The config layer's error type (no dependencies, so every config module and the roles can raise it)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config key, value or combination is invalid; the message says which and what is valid."""
