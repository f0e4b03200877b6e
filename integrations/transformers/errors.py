"""The error slipstream's Trainer raises for arguments it does not run."""

from __future__ import annotations


class TrainerConfigurationError(ValueError):
    """The Trainer's arguments ask for something slipstream's Trainer does not do."""
