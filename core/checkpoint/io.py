"""Readers and writers that strategies use to put their parts of a checkpoint on storage.

A :class:`CheckpointWriter` writes into the staging folder of a save and remembers every
file it wrote (the manifest lists them, so a partial copy is detected on load); a
:class:`CheckpointReader` reads from a committed checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..runtime.state import ProcessState
from .commit import CheckpointError
from .serialization import load_object, load_tensors, save_object, save_tensors
from .storage import Storage


class CheckpointWriter:
    """Writes files of one checkpoint for this process.

    With ``deferred`` the writes are recorded with a CPU snapshot of their content and done
    later by :meth:`flush` (asynchronous saving: training may change the tensors meanwhile).
    :attr:`owner` says whether this process writes the files that every process of the
    folder would write alike (replicated weights, schedulers): the main process, or the
    first process of a folder the main process does not share (node-local disks).
    """

    def __init__(
        self,
        storage: Storage,
        folder: str,
        state: ProcessState,
        deferred: bool = False,
        owner: bool | None = None,
    ) -> None:
        self.storage = storage
        self.folder = folder
        self.state = state
        self.deferred = deferred
        self.owner = state.is_main_process if owner is None else owner
        self.written: list[str] = []
        self.pending: list[Callable[[], None]] = []
        self.error: str | None = None

    def path(self, name: str) -> str:
        return self.storage.join(self.folder, name)

    def save_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], **kwargs: Any) -> None:
        path = self.path(name)
        if self.deferred:
            copies = snapshot(dict(tensors))
            self.pending.append(lambda: save_tensors(self.storage, path, copies, **kwargs))
        else:
            save_tensors(self.storage, path, tensors, **kwargs)
        self.written.append(name)

    def save_object(self, name: str, obj: Any) -> None:
        path = self.path(name)
        if self.deferred:
            copy = snapshot(obj)
            self.pending.append(lambda: save_object(self.storage, path, copy))
        else:
            save_object(self.storage, path, obj)
        self.written.append(name)

    def flush(self) -> None:
        """Do the deferred writes; an error is kept in :attr:`error` (for a thread)."""
        try:
            for write in self.pending:
                write()
        except Exception as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.pending = []


def snapshot(data: Any) -> Any:
    """A copy whose tensors are fresh CPU tensors and whose containers are new."""
    if isinstance(data, torch.Tensor):
        return data.detach().to("cpu", copy=True)
    if isinstance(data, dict):
        return {k: snapshot(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(snapshot(v) for v in data)
    return copy.deepcopy(data)


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
