"""Single-file checkpoints (Lightning's format) on local paths, memory://, s3://, ..."""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import torch

from slipstream.checkpoint import Storage, load_weights, save_weights

__all__ = ["FsspecCheckpointIO", "load_weights", "save_weights"]


class FsspecCheckpointIO:
    """Save, load and remove one-file checkpoints on any fsspec URL.

    Saving is atomic: on local disks the file is written under a temporary name and
    renamed; on object stores a single upload is atomic by itself. Loading uses
    ``torch.load(weights_only=True)`` unless told otherwise.
    """

    def __init__(self, weights_only: bool = True) -> None:
        self.weights_only = weights_only

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("FsspecCheckpointIO takes no storage_options; configure fsspec instead")
        storage = Storage.for_url(path)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        if storage.is_local:
            temporary = f"{storage.root}.tmp-{uuid.uuid4().hex[:8]}"
            storage.write_bytes(temporary, buffer.getvalue())
            storage.move(temporary, storage.root)
        else:
            storage.write_bytes(storage.root, buffer.getvalue())

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        storage = Storage.for_url(path)
        if not storage.exists(storage.root):
            raise FileNotFoundError(f"checkpoint {storage.url(storage.root)} does not exist")
        safe = self.weights_only if weights_only is None else weights_only
        try:
            loaded: dict[str, Any] = torch.load(
                storage.readable(storage.root), map_location=map_location, weights_only=safe
            )
        except Exception as error:
            if not safe:
                raise
            raise ValueError(
                f"{storage.url(storage.root)} holds objects torch.load(weights_only=True) "
                f"refuses ({error}); if you trust the file, load it with weights_only=False"
            ) from None
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        storage = Storage.for_url(path)
        storage.remove(storage.root)

    def teardown(self) -> None:
        """Nothing to release (kept for Lightning's CheckpointIO interface)."""
