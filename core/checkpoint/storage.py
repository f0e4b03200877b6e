"""Storage: one place where checkpoint files are read and written, through fsspec.

Local paths, ``file://``, ``memory://`` and ``s3://`` (with s3fs installed) all work the
same way; any other fsspec protocol whose package is installed works too.

Example::

    storage = Storage.for_url("s3://bucket/run1")
    storage.write_bytes(storage.join("a", "b.bin"), b"...")
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import fsspec


class StorageError(OSError):
    """A checkpoint location cannot be used (unknown protocol, missing package, ...)."""


class Storage:
    """An fsspec filesystem plus helpers; paths are the filesystem's own (no protocol)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root

    @classmethod
    def for_url(cls, url: str | os.PathLike[str]) -> Storage:
        """The storage holding ``url`` (a local path or any fsspec URL)."""
        import fsspec

        text = os.fspath(url)
        try:
            fs, root = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as error:
            protocol = text.split("://", 1)[0] if "://" in text else "file"
            hint = " (pip install 'slipstream[s3]')" if protocol in ("s3", "s3a") else ""
            raise StorageError(f"cannot open {text!r}: {error}{hint}") from None
        if getattr(fs, "protocol", None) in ("file", ("file", "local")) or _is_local(fs):
            root = os.path.abspath(root)
        return cls(fs, root.rstrip("/") or "/")

    @property
    def is_local(self) -> bool:
        return _is_local(self.fs)

    def url(self, path: str) -> str:
        """``path`` as a URL users recognise (local paths stay plain)."""
        if self.is_local:
            return path
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{path.lstrip('/')}" if protocol != "memory" else f"memory://{path}"

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts) if not self.is_local else os.path.join(*parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(path) if self.is_local else posixpath.dirname(path)

    def name(self, path: str) -> str:
        return os.path.basename(path) if self.is_local else posixpath.basename(path)

    # -- queries --------------------------------------------------------------------------
    def _fresh(self) -> None:
        # Object-store filesystems cache listings; other processes write concurrently.
        if not self.is_local:
            self.fs.invalidate_cache()

    def exists(self, path: str) -> bool:
        self._fresh()
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        self._fresh()
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries in ``path``; empty when it does not exist."""
        self._fresh()
        if not self.fs.exists(path):
            return []
        return sorted(self.name(p.rstrip("/")) for p in self.fs.ls(path, detail=False))

    # -- reading and writing ----------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    @contextmanager
    def open(self, path: str, mode: str = "rb") -> Iterator[IO[Any]]:
        if "w" in mode:
            self.makedirs(self.parent(path))
        with self.fs.open(path, mode) as handle:
            yield handle

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open(path, "wb") as handle:
            handle.write(data)

    def read_bytes(self, path: str) -> bytes:
        with self.open(path, "rb") as handle:
            data: bytes = handle.read()
        return data

    def write_text(self, path: str, text: str) -> None:
        self.write_bytes(path, text.encode())

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode()

    def readable(self, path: str) -> IO[bytes]:
        """A seekable in-memory copy (for readers that need random access)."""
        return io.BytesIO(self.read_bytes(path))

    # -- moving and deleting ------------------------------------------------------------------
    def move(self, source: str, destination: str) -> None:
        """Rename a file or folder (atomic on local filesystems)."""
        if self.is_local:
            os.replace(source, destination)
        else:
            self.fs.mv(source, destination, recursive=True)

    def remove(self, path: str) -> None:
        """Delete a file or folder tree if it exists."""
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
