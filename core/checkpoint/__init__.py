"""Checkpoints: exact-resume training state, atomic commits, model weights, any fsspec URL."""

from .commit import MARKER, CheckpointError
from .manager import Checkpointer, TrainingObjects
from .storage import Storage, StorageError
from .weights import load_weights, save_weights

__all__ = [
    "MARKER",
    "CheckpointError",
    "Checkpointer",
    "Storage",
    "StorageError",
    "TrainingObjects",
    "load_weights",
    "save_weights",
]
