"""Checkpoints: exact-resume training state, atomic commits, model weights, any fsspec URL.

Submodules are imported on first use, so ``import slipstream`` does not load fsspec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MARKER": "commit",
    "CheckpointError": "commit",
    "Checkpointer": "manager",
    "TrainingObjects": "manager",
    "Storage": "storage",
    "StorageError": "storage",
    "export_weights": "weights",
    "load_weights": "weights",
    "save_weights": "weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
