"""Checkpoints of the Lightning adapter, written through slipstream's core.

* One file (DDP, FSDP with ``FULL_STATE_DICT``): :class:`SlipstreamCheckpointIO`, a Lightning
  ``CheckpointIO`` that delegates to :class:`slipstream.integrations.fsspec.FsspecCheckpointIO`
  — any fsspec URL works (local paths, ``memory://``, ``s3://``), saves are atomic.
* A folder (FSDP with ``SHARDED_STATE_DICT``, DeepSpeed): the core strategy writes the model
  and optimizers in its own layout (torch.distributed.checkpoint parts, the DeepSpeed engine
  checkpoint) and the main process adds the rest of Lightning's checkpoint
  (:data:`LIGHTNING_STATE`); the folder is committed atomically like ``save_state``'s.

Example::

    trainer = Trainer(strategy="slipstream")           # uses SlipstreamCheckpointIO
    trainer.save_checkpoint("memory://runs/last.ckpt")
    trainer.fit(model, ckpt_path="s3://bucket/runs/last.ckpt")
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins import CheckpointIO

from slipstream.checkpoint import CheckpointError, Storage
from slipstream.checkpoint.commit import (
    MARKER,
    Location,
    prepare_target,
    publish,
    read_marker,
    recover,
    write_marker,
)
from slipstream.checkpoint.io import CheckpointReader, CheckpointWriter
from slipstream.integrations.fsspec import FsspecCheckpointIO
from slipstream.runtime import collectives
from slipstream.runtime.state import ProcessState

T = TypeVar("T")

#: The file in a checkpoint folder holding Lightning's own state (loops, callbacks, ...).
LIGHTNING_STATE = "lightning_state.ckpt"
#: Consolidated (optionally 16-bit) weights written next to sharded parts on request.
CONSOLIDATED = "model.safetensors"


class SlipstreamCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` on any fsspec URL, through slipstream's storage layer.

    Example::

        trainer = Trainer(plugins=[SlipstreamCheckpointIO()])
        trainer.save_checkpoint("s3://bucket/run/epoch=3.ckpt")
    """

    def __init__(self, weights_only: bool = True) -> None:
        self._io = FsspecCheckpointIO(weights_only=weights_only)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "SlipstreamCheckpointIO takes no storage_options; configure the filesystem "
                "through fsspec (e.g. fsspec.config.conf['s3'] = {...})"
            )
        self._io.save_checkpoint(checkpoint, path)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        location = map_location if map_location is not None else "cpu"
        return self._io.load_checkpoint(path, map_location=location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self._io.remove_checkpoint(path)  # files and checkpoint folders alike


# -- agreeing on outcomes -------------------------------------------------------------------------
def on_main(state: ProcessState, action: Callable[[], T]) -> T:
    """Run ``action`` on the main process; every process gets its result or its error, so a
    failed write raises everywhere instead of leaving the others waiting in a barrier."""
    outcome: list[Any] = [None, None]
    if state.is_main_process:
        try:
            outcome = [action(), None]
        except Exception as error:
            outcome = [None, f"{type(error).__name__}: {error}"]
    outcome = collectives.broadcast_object_list(outcome, 0, state=state)
    if outcome[1] is not None:
        raise CheckpointError(f"on the main process: {outcome[1]}")
    return outcome[0]  # type: ignore[no-any-return]


def everyone(state: ProcessState, action: Callable[[], T]) -> T:
    """Run ``action`` on every process; if it fails anywhere, raise on all of them."""
    result: Any = None
    error: str | None = None
    try:
        result = action()
    except Exception as exc:
        if state.num_processes == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    errors = collectives.gather_object([error], state=state)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError("; ".join(f"process {rank}: {e}" for rank, e in failed))
    return result  # type: ignore[no-any-return]


# -- sharded folders -------------------------------------------------------------------------------
def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint folder written by :func:`save_sharded`."""
    storage = Storage.for_url(path)
    folder = recover(storage, storage.root)
    return storage.isdir(folder) and storage.exists(storage.join(folder, MARKER))


def save_sharded(
    state: ProcessState,
    core: Any,
    model: torch.nn.Module,
    optimizers: list[Any],
    checkpoint: dict[str, Any],
    path: str,
    weights_dtype: torch.dtype | None = None,
) -> None:
    """Write ``checkpoint`` as a folder: the core strategy's model/optimizer parts, plus
    Lightning's remaining state from the main process. Collective."""
    storage = Storage.for_url(path)
    token = on_main(state, lambda: uuid.uuid4().hex[:12])
    location = Location(storage, storage.root, token)
    on_main(state, lambda: prepare_target(location))
    writer = CheckpointWriter(storage, location.staging, state)
    state_dict = checkpoint.pop("state_dict", {})
    optimizer_states = checkpoint.pop("optimizer_states", None)

    def write_parts() -> None:
        core.save_model_checkpoint(model, state_dict, writer, 0)
        if optimizer_states is not None:  # None: trainer.save_checkpoint(weights_only=True)
            for index, optimizer in enumerate(optimizers):
                core.save_optimizer_checkpoint(optimizer, writer, index)

    everyone(state, write_parts)
    if weights_dtype is not None:
        # Consolidated 16-bit weights beside the shards (collective gather, main writes).
        full = core.model_state_dict(model)
        on_main(state, lambda: writer.save_tensors(CONSOLIDATED, full, dtype=weights_dtype))
    files = collectives.gather_object([writer.written], state=state)
    # Placeholders keep Lightning's "optimizer_states" check happy on load; the states
    # themselves are in the core strategy's files.
    rest = dict(checkpoint)
    if optimizer_states is not None:
        rest["optimizer_states"] = [{} for _ in optimizer_states]
    manifest = {
        "lightning": True,
        "strategy": core.name,
        "num_processes": state.num_processes,
        "optimizers": len(optimizers) if optimizer_states is not None else 0,
        "files": {str(rank): names for rank, names in enumerate(files)},
    }

    def commit() -> None:
        FsspecCheckpointIO().save_checkpoint(
            rest, storage.url(storage.join(location.staging, LIGHTNING_STATE))
        )
        write_marker(storage, location.staging, manifest)
        publish(location)

    on_main(state, commit)


def open_sharded(
    state: ProcessState, path: str, weights_only: bool | None
) -> tuple[dict[str, Any], CheckpointReader]:
    """Lightning's state from a checkpoint folder, and a reader for the core's parts."""
    storage = Storage.for_url(path)
    folder = recover(storage, storage.root)
    manifest = read_marker(storage, folder)
    url = storage.url(folder)
    if not manifest.get("lightning"):
        raise CheckpointError(
            f"{url} is a slipstream save_state() checkpoint, not a Lightning one; load it with "
            "Accelerator.load_state, or pass a checkpoint written by trainer.save_checkpoint"
        )
    present = set(storage.listdir(folder))
    listed = {name for names in manifest["files"].values() for name in names}
    missing = sorted(listed - present)
    if missing:
        raise CheckpointError(f"{url} is incomplete: {missing[:6]} are missing")
    rest = FsspecCheckpointIO().load_checkpoint(
        storage.url(storage.join(folder, LIGHTNING_STATE)),
        map_location="cpu",
        weights_only=weights_only,
    )
    return rest, CheckpointReader(storage, folder, state, manifest)


# -- one-file checkpoints of sharded models ------------------------------------------------------
class MemoryParts:
    """Hands the core strategy's checkpoint methods an in-memory "folder".

    FSDP with ``FULL_STATE_DICT`` stores its full optimizer state in Lightning's single file:
    the core writes it into a :meth:`writer` (captured here instead of written), and reads it
    back through a :meth:`reader` serving the objects of the loaded Lightning checkpoint.
    """

    def __init__(self, state: ProcessState, objects: dict[str, Any] | None = None) -> None:
        self.state = state
        self.objects: dict[str, Any] = dict(objects or {})
        # An empty in-memory folder: the core's "is there a sharded part?" checks say no.
        self.storage = Storage.for_url(f"memory://slipstream-lightning/{uuid.uuid4().hex}")

    def writer(self) -> CheckpointWriter:
        parts = self

        class _Writer(CheckpointWriter):
            def save_tensors(self, name: str, tensors: Any, **kwargs: Any) -> None:
                parts.objects[name] = dict(tensors)
                self.written.append(name)

            def save_object(self, name: str, obj: Any) -> None:
                parts.objects[name] = obj
                self.written.append(name)

        return _Writer(self.storage, self.storage.root, self.state)

    def reader(self) -> CheckpointReader:
        parts = self

        class _Reader(CheckpointReader):
            def _get(self, name: str, what: str) -> Any:
                if name not in parts.objects:
                    raise CheckpointError(f"the checkpoint has no {what} ({name})")
                return parts.objects[name]

            def load_tensors(self, name: str, what: str) -> dict[str, torch.Tensor]:
                return dict(self._get(name, what))

            def load_object(self, name: str, what: str) -> Any:
                return self._get(name, what)

        return _Reader(self.storage, self.storage.root, self.state, {})
