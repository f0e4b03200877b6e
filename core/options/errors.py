"""The base error for configuration a user must change (a file, a key, an argument)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the file, key and fix."""
