"""Accelerate's names for the files and folders of a checkpoint, so a folder written by one
library loads in the other: ``model.safetensors``, ``model_1.safetensors``,
``pytorch_model_fsdp_0/``, ``optimizer_0/``...

Example::

    indexed_name("model", 1, ".safetensors")   # "model_1.safetensors"
"""

from __future__ import annotations

_MODEL_FOLDER = "pytorch_model_fsdp_{}"
_OPTIMIZER_FOLDER = "optimizer_{}"


def indexed_name(stem: str, index: int, suffix: str) -> str:
    """Accelerate's file names: ``model.safetensors``, ``model_1.safetensors``, ..."""
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def model_folder(index: int) -> str:
    """The folder of model ``index``'s sharded weights."""
    return _MODEL_FOLDER.format(index)


def optimizer_folder(index: int) -> str:
    """The folder of optimizer ``index``'s sharded state."""
    return _OPTIMIZER_FOLDER.format(index)
