"""Where offloaded weights wait between forwards: in RAM, or on disk in safetensors files.

An offload folder holds ``index.json``, which maps every offloaded tensor to a safetensors
file and key: the checkpoint's own files where it was safetensors (nothing is rewritten),
or ``offloaded-*.safetensors`` written into the folder for other formats. Reading goes
through a private memory map: on a CPU a tensor is used straight from the mapped pages,
which are handed back after the forward.

Example::

    offload_state_dict("offload/", model.state_dict())
    weights = OffloadedWeightsLoader(save_folder="offload/")
    weights["layers.3.weight"]        # read from disk now
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.commit import CheckpointError
from .sources import SAFETENSORS_NAMES, SafetensorsFile
from .tensors import resolve_dtype

INDEX = "index.json"
FORMAT = "slipstream-offload/1"


@dataclass(frozen=True)
class OffloadEntry:
    """Where one offloaded tensor lives: a safetensors file, its key there, and the dtype
    it is used in (converted on reading when the file holds another)."""

    file: str
    key: str
    dtype: torch.dtype | None = None


def read_index(folder: str) -> dict[str, OffloadEntry]:
    """The entries of ``folder``'s ``index.json``; ``{}`` if there is none."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        return {}
    with open(path) as handle:
        body = json.load(handle)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a slipstream offload index (written by another tool?); use an "
            "empty offload folder"
        )
    entries = {}
    for name, spec in body["tensors"].items():
        file = spec["file"] if os.path.isabs(spec["file"]) else os.path.join(folder, spec["file"])
        entries[name] = OffloadEntry(file, spec["key"], resolve_dtype(spec.get("dtype")))
    return entries


def write_index(folder: str, entries: Mapping[str, OffloadEntry]) -> None:
    """Write ``index.json`` atomically (processes sharing a folder never see half of one)."""
    tensors = {}
    for name, entry in entries.items():
        inside = os.path.dirname(os.path.abspath(entry.file)) == os.path.abspath(folder)
        tensors[name] = {
            "file": os.path.basename(entry.file) if inside else os.path.abspath(entry.file),
            "key": entry.key,
            "dtype": str(entry.dtype).removeprefix("torch.") if entry.dtype else None,
        }
    _atomic_write(os.path.join(folder, INDEX), json.dumps({"format": FORMAT, "tensors": tensors}))


def _atomic_write(path: str, text: str) -> None:
    staging = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(staging, "w") as handle:
        handle.write(text)
    os.replace(staging, path)


class OffloadWriter:
    """Writes tensors, one at a time and in any order, into one new safetensors file whose
    layout is fixed up front from their dtypes and shapes.

    The file appears under its final name only when :meth:`finish` is called, so a crash
    never leaves a half-written file that an index points to.
    """

    def __init__(
        self,
        folder: str,
        specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        origin: str = "",
    ) -> None:
        os.makedirs(folder, exist_ok=True)
        # Named after what it holds: writing the same again (a script run twice) replaces
        # the file instead of adding a copy. Readers keep the file they opened.
        layout = [(k, str(d), list(s)) for k, (d, s) in sorted(specs.items())]
        digest = hashlib.sha1(json.dumps([origin, layout]).encode()).hexdigest()[:16]
        self.path = os.path.join(folder, f"offloaded-{digest}.safetensors")
        self._staging = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
        header: dict[str, Any] = {}
        self._offsets: dict[str, int] = {}
        offset = 0
        for key, (dtype, shape) in specs.items():
            size = torch.empty(shape, dtype=dtype, device="meta").nbytes
            header[key] = {
                "dtype": SAFETENSORS_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._offsets[key] = offset
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors asks
        self._start = 8 + len(raw)
        self._specs = dict(specs)
        self._fd = os.open(self._staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, len(raw).to_bytes(8, "little") + raw)
        os.ftruncate(self._fd, self._start + offset)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        dtype, shape = self._specs[key]
        data = tensor.detach().to("cpu", dtype).contiguous().reshape(shape)
        if data.numel():
            raw = data.view(-1).view(torch.uint8).numpy()
            os.pwrite(self._fd, raw.data, self._start + self._offsets[key])

    def finish(self) -> str:
        os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self._staging, self.path)
        return self.path

    def abort(self) -> None:
        os.close(self._fd)
        if os.path.exists(self._staging):
            os.remove(self._staging)


def offload_state_dict(
    save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]
) -> None:
    """Write ``state_dict`` into the offload folder ``save_dir`` (tensors and index); names
    sharing one tensor (tied weights) are written once.

    Example::

        offload_state_dict("offload/", {"weight": torch.ones(4, 4)})
    """
    folder = os.fspath(save_dir)
    first: dict[tuple[Any, ...], str] = {}
    stored_as: dict[str, str] = {}
    for name, tensor in state_dict.items():
        identity = (
            tensor.device,
            tensor.data_ptr(),
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
        )
        shared = tensor.numel() > 0 and not tensor.is_meta
        stored_as[name] = first.setdefault(identity, name) if shared else name
    unique = {name: state_dict[name] for name in dict.fromkeys(stored_as.values())}
    writer = OffloadWriter(folder, {k: (v.dtype, tuple(v.shape)) for k, v in unique.items()})
    try:
        for key, tensor in unique.items():
            writer.write(key, tensor)
        path = writer.finish()
    except BaseException:
        writer.abort()
        raise
    fresh = {name: OffloadEntry(path, key, None) for name, key in stored_as.items()}
    write_index(folder, {**read_index(folder), **fresh})


class OffloadedWeightsLoader(Mapping[str, torch.Tensor]):
    """Offloaded weights by name: tensors kept in RAM (``state_dict``) and tensors on disk
    (``save_folder``'s index, or ``index``), read when looked up.

    Disk tensors come straight from the mapped file pages (no copy) when their dtype needs
    no conversion; :meth:`release` hands the pages back once a forward is done with them.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike[str] | None = None,
        index: Mapping[str, OffloadEntry] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.state_dict = dict(state_dict or {})
        self.index = dict(read_index(os.fspath(save_folder)) if save_folder is not None else {})
        self.index.update(index or {})
        self.device = device
        self._files: dict[str, SafetensorsFile] = {}

    def _file(self, path: str) -> SafetensorsFile:
        found = self._files.get(path)
        if found is None:
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"offloaded weights are read from {path}, which no longer exists (was the "
                    "checkpoint or offload folder moved or deleted?)"
                )
            found = self._files[path] = SafetensorsFile(path)
        return found

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise unless ``name`` is here with ``shape``."""
        if name in self.state_dict:
            have = tuple(self.state_dict[name].shape)
        elif name in self.index:
            entry = self.index[name]
            file = self._file(entry.file)
            if entry.key not in file.spans:
                raise CheckpointError(f"{entry.file} has no tensor {entry.key!r} (for {name})")
            have = file.info(entry.key).shape
        else:
            raise KeyError(name)
        if have != tuple(shape):
            raise CheckpointError(
                f"offloaded {name!r} has shape {have}, but the model's is {tuple(shape)} (a "
                "stale offload folder? load the checkpoint again)"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.state_dict:
            tensor = self.state_dict[name]
        else:
            entry = self.index[name]
            file = self._file(entry.file)
            tensor = file.tensor(entry.key)
            if (
                entry.dtype is not None
                and tensor.dtype != entry.dtype
                and tensor.is_floating_point()
            ):
                tensor = tensor.to(entry.dtype)
                file.release(entry.key)
        return tensor if self.device is None else tensor.to(self.device)

    def source_of(self, name: str) -> tuple[Any, ...]:
        """What ``name`` is read from: names with the same source are one tied tensor."""
        if name in self.state_dict:
            tensor = self.state_dict[name]
            if tensor.numel() == 0:
                return ("memory", id(tensor))
            return ("memory", tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        entry = self.index[name]
        return ("file", entry.file, entry.key)

    def release(self, name: str) -> None:
        """A forward is done with ``name``: its file pages may leave this process's memory."""
        entry = self.index.get(name)
        if entry is not None and name not in self.state_dict:
            self._file(entry.file).release(entry.key)

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.state_dict), **dict.fromkeys(self.index)})

    def __len__(self) -> int:
        return len(set(self.state_dict) | set(self.index))

    def __contains__(self, name: object) -> bool:
        return name in self.state_dict or name in self.index


class PrefixedDataset(Mapping[str, torch.Tensor]):
    """The entries of ``dataset`` under ``prefix``, named without it (a submodule's view)."""

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.dataset[self.prefix + name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (self.prefix + name) in self.dataset

    def __iter__(self) -> Iterator[str]:
        return (k[len(self.prefix) :] for k in self.dataset if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def release(self, name: str) -> None:
        release = getattr(self.dataset, "release", None)
        if release is not None:
            release(self.prefix + name)

    def source_of(self, name: str) -> tuple[Any, ...]:
        source_of = getattr(self.dataset, "source_of", None)
        return (
            source_of(self.prefix + name) if source_of is not None else ("key", self.prefix + name)
        )
