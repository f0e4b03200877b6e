"""Readers and writers that strategies use to put their parts of a checkpoint on storage.

A :class:`CheckpointWriter` writes into the staging folder of a save and remembers every
file it wrote (the manifest lists them, so a partial copy is detected on load); a
:class:`CheckpointReader` reads from a committed checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..state import ProcessState
from .commit import CheckpointError
from .serialization import load_object, load_tensors, save_object, save_tensors
from .storage import Storage


class CheckpointWriter:
    """Writes files of one checkpoint for this process."""

    def __init__(self, storage: Storage, folder: str, state: ProcessState) -> None:
        self.storage = storage
        self.folder = folder
        self.state = state
        self.written: list[str] = []

    def path(self, name: str) -> str:
        return self.storage.join(self.folder, name)

    def save_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], **kwargs: Any) -> None:
        save_tensors(self.storage, self.path(name), tensors, **kwargs)
        self.written.append(name)

    def save_object(self, name: str, obj: Any) -> None:
        save_object(self.storage, self.path(name), obj)
        self.written.append(name)


class CheckpointReader:
    """Reads files of one committed checkpoint."""

    def __init__(
        self, storage: Storage, folder: str, state: ProcessState, manifest: dict[str, Any]
    ) -> None:
        self.storage = storage
        self.folder = folder
        self.state = state
        self.manifest = manifest

    def path(self, name: str) -> str:
        return self.storage.join(self.folder, name)

    def require(self, name: str, what: str) -> str:
        path = self.path(name)
        if not self.storage.exists(path):
            raise CheckpointError(
                f"{self.storage.url(self.folder)} has no {name} ({what}); it holds: "
                f"{', '.join(self.storage.listdir(self.folder))}"
            )
        return path

    def load_tensors(self, name: str, what: str) -> dict[str, torch.Tensor]:
        return load_tensors(self.storage, self.require(name, what))

    def load_object(self, name: str, what: str) -> Any:
        return load_object(self.storage, self.require(name, what))
