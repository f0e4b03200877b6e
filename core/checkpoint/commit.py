"""Atomic checkpoint commits, discovery of complete checkpoints, and rotation.

A checkpoint is a folder whose marker file, :data:`MARKER`, is written last — only after
every process has written its part; a folder without a marker is never mistaken for one.

On local filesystems a save goes to a hidden staging folder next to the target, renamed
into place once committed: a process killed at any moment leaves every earlier checkpoint,
including one at the same path, loadable. Object stores (s3, memory) have no folder
renames: there the files are written in place and the marker commits them; overwriting the
same path first invalidates the old checkpoint there (automatic naming never overwrites).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .storage import Storage

MARKER = "checkpoint.json"
FORMAT_VERSION = 1
_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match what is being loaded."""


@dataclass(frozen=True)
class Location:
    """Where a checkpoint lives: its storage, final path and staging path."""

    storage: Storage
    path: str
    token: str

    @property
    def staging(self) -> str:
        """Where the processes write: a hidden sibling on local disks, else the path."""
        return self.sibling("incomplete") if self.storage.is_local else self.path

    @property
    def replaced(self) -> str:
        return self.sibling("replaced")

    def sibling(self, kind: str) -> str:
        name = self.storage.name(self.path)
        return self.storage.join(self.storage.parent(self.path), f".{name}.{kind}-{self.token}")


def write_marker(storage: Storage, folder: str, manifest: dict[str, Any]) -> None:
    body = {"format": FORMAT_VERSION, **manifest}
    storage.write_text(storage.join(folder, MARKER), json.dumps(body, indent=1, sort_keys=True))


def read_marker(storage: Storage, folder: str) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError explains anything else."""
    url = storage.url(folder)
    if not storage.exists(folder):
        raise CheckpointError(
            f"no checkpoint at {url}: the path does not exist (a save interrupted before it "
            "committed leaves only a hidden .NAME.incomplete-* folder beside it)"
        )
    if not storage.isdir(folder):
        raise CheckpointError(f"{url} is a file, not a checkpoint folder")
    marker = storage.join(folder, MARKER)
    if not storage.exists(marker):
        present = storage.listdir(folder)
        if not present:
            raise CheckpointError(f"{url} is an empty folder, not a checkpoint")
        raise CheckpointError(
            f"{url} is not a complete slipstream checkpoint: {MARKER} is missing (it is "
            f"written last, so a save was interrupted or this is another kind of folder); "
            f"it contains: {', '.join(present[:12])}{' ...' if len(present) > 12 else ''}"
        )
    manifest: dict[str, Any] = json.loads(storage.read_text(marker))
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{url} has checkpoint format {manifest.get('format')!r}; this slipstream reads "
            f"format {FORMAT_VERSION}"
        )
    return manifest


def is_complete(storage: Storage, folder: str) -> bool:
    return storage.exists(storage.join(folder, MARKER))


def prepare_target(location: Location) -> None:
    """Create the folder the processes write into; in place (object stores), first
    invalidate and clear an old checkpoint at the path."""
    storage, path = location.storage, location.path
    if not storage.is_local and storage.exists(path):
        storage.remove(storage.join(path, MARKER))
        storage.remove(path)
    storage.makedirs(location.staging)


def publish(location: Location) -> None:
    """Move the staged checkpoint to its final path (replacing an older one there)."""
    storage, path = location.storage, location.path
    if not storage.is_local:
        return  # written in place; the marker was the commit
    if storage.exists(path):
        storage.move(path, location.replaced)
    storage.move(location.staging, path)
    storage.remove(location.replaced)
    parent = storage.parent(path)
    prefixes = tuple(f".{storage.name(path)}.{kind}-" for kind in ("incomplete", "probe"))
    for leftover in storage.listdir(parent):
        if leftover.startswith(prefixes):
            storage.remove(storage.join(parent, leftover))  # from earlier interrupted saves


def recover(storage: Storage, path: str) -> str:
    """``path``, or the complete copy an interrupted replacement of ``path`` left behind."""
    if storage.exists(path):
        return path
    parent, name = storage.parent(path), storage.name(path)
    for kind in ("replaced", "incomplete"):
        for entry in storage.listdir(parent):
            candidate = storage.join(parent, entry)
            if entry.startswith(f".{name}.{kind}-") and is_complete(storage, candidate):
                return candidate
    return path


def automatic_checkpoints(storage: Storage, folder: str) -> list[tuple[int, str]]:
    """``(number, path)`` of the complete ``checkpoint_N`` folders, oldest first."""
    found = []
    for entry in storage.listdir(folder):
        match = _AUTOMATIC.match(entry)
        path = storage.join(folder, entry)
        if match and is_complete(storage, path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def next_automatic_index(storage: Storage, folder: str) -> int:
    """One more than the largest ``checkpoint_N`` present (complete or not)."""
    numbers = [int(m.group(1)) for e in storage.listdir(folder) if (m := _AUTOMATIC.match(e))]
    return max(numbers, default=-1) + 1


def rotate(storage: Storage, folder: str, keep: int) -> list[str]:
    """Delete the oldest complete automatic checkpoints beyond ``keep``; returns them."""
    complete = automatic_checkpoints(storage, folder)
    doomed = [path for _, path in complete[: max(0, len(complete) - keep)]]
    for path in doomed:
        storage.remove(path)
    return doomed
