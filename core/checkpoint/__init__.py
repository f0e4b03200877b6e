"""Checkpoints: exact-resume training state, atomic commits, model weights, any fsspec URL.

Submodules are imported on first use, so ``import slipstream`` does not load fsspec.
"""

from __future__ import annotations

from ..runtime.lazy import lazy_exports

_EXPORTS = {
    "MARKER": "commit",
    "CheckpointError": "commit",
    "Storage": "storage",
    "StorageError": "storage",
    "export_weights": "weights",
    "load_weights": "weights",
    "merge_weights": "merge",
    "save_weights": "weights",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
