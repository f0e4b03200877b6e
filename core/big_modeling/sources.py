"""Checkpoint files read one tensor at a time, without ever holding the whole model.

Formats: a safetensors file; a folder of safetensors (or ``.bin``) shards with their
``*.index.json`` (the layout of transformers' ``save_pretrained`` and slipstream's
``save_model``); a single ``pytorch_model.bin``; a torch.distributed.checkpoint folder
(a sharded ``save_state``, or the folder inside it).

Safetensors files are memory-mapped privately: a tensor is a view of the file's pages, and
:meth:`SafetensorsFile.release` hands those pages back once the tensor has been copied, so
the resident memory of reading a 100 GB checkpoint is one tensor, not the file.

Example::

    checkpoint = open_checkpoint("llama/")          # the folder with model.safetensors.index.json
    for source in checkpoint.sources:
        for key in source.names():
            tensor = source.read(key)               # a view of the mapped file
            ...                                     # copy it where it belongs
            source.release(key)
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.commit import CheckpointError

_ALIASES_KEY = "slipstream_aliases"  # tied names saved once (checkpoint/serialization.py)
_MAX_HEADER = 100 * 2**20
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
    }.items()
    if dtype is not None
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor, before reading it."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Span:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


class SafetensorsFile:
    """One safetensors file: its header now, its tensors through a private memory map.

    The file stays open from here on, so a file later replaced under the same name (an
    offload folder written again) does not change what this object reads. The map is
    copy-on-write (a tensor written to changes this process's copy, never the file) and
    made on the first read.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.spans = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> dict[str, _Span]:
        path, fd = self.path, self._fd
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if length < 2 or length > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
        try:
            header: dict[str, Any] = json.loads(os.pread(fd, length, 8))
        except ValueError:
            raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
        start = 8 + length
        metadata = header.pop("__metadata__", None) or {}
        spans: dict[str, _Span] = {}
        for key, spec in header.items():
            dtype = _SAFETENSORS_DTYPES.get(spec.get("dtype"))
            if dtype is None:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has unknown dtype {spec.get('dtype')!r}"
                )
            shape = tuple(int(n) for n in spec["shape"])
            begin, end = (start + int(o) for o in spec["data_offsets"])
            expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected or end > size:
                raise CheckpointError(
                    f"{path}: tensor {key!r} does not fit the file (truncated or corrupt)"
                )
            spans[key] = _Span(dtype, shape, begin, end)
        for alias, original in json.loads(metadata.get(_ALIASES_KEY, "{}")).items():
            if original in spans:
                spans[alias] = spans[original]
        return spans

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        return self._map

    def names(self) -> list[str]:
        return list(self.spans)

    def info(self, key: str) -> TensorInfo:
        span = self.spans[key]
        return TensorInfo(span.dtype, span.shape)

    def tensor(self, key: str) -> torch.Tensor:
        """``key`` as a view of the mapped file (a copy when the data is misaligned)."""
        span = self.spans[key]
        count = _numel(span.shape)
        if count == 0:
            return torch.empty(span.shape, dtype=span.dtype)
        itemsize = torch.empty((), dtype=span.dtype).element_size()
        mapping = self._mapping()
        if span.begin % itemsize:
            data = bytearray(mapping[span.begin : span.end])
            return torch.frombuffer(data, dtype=span.dtype, count=count).view(span.shape)
        return torch.frombuffer(mapping, dtype=span.dtype, count=count, offset=span.begin).view(
            span.shape
        )

    def release(self, key: str) -> None:
        """Drop ``key``'s pages from this process's memory (the page cache keeps them).

        Safe while a view is still alive: its next read maps the pages again.
        """
        advise = getattr(self._map, "madvise", None)
        if advise is None:
            return
        span = self.spans[key]
        page = mmap.PAGESIZE
        # Whole pages inside the tensor only: a neighbour sharing an edge page keeps it.
        first, last = -(-span.begin // page) * page, span.end // page * page
        if last > first:
            advise(mmap.MADV_DONTNEED, first, last - first)

    def close(self) -> None:
        # Never mmap.close(): tensors made by torch.frombuffer do not pin the buffer, and
        # closing would unmap memory they still point to. They hold a reference to the map
        # instead, so dropping ours unmaps it once the last of them is gone.
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


class Source:
    """One file (or folder) of a checkpoint."""

    name: str

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def names(self) -> list[str]:
        return list(self.infos())

    def read(self, key: str) -> torch.Tensor:
        """``key`` on the CPU; valid until :meth:`release` (copy it to keep it)."""
        raise NotImplementedError

    def release(self, key: str) -> None:
        """``key`` has been copied where it belongs."""

    def reference(self, key: str) -> tuple[str, str] | None:
        """(safetensors file, key) to read ``key`` from later, if it can be read in place."""
        return None

    def close(self) -> None:
        """Done reading this source."""


class SafetensorsSource(Source):
    def __init__(self, path: str) -> None:
        self.name = path
        self.file = SafetensorsFile(path)

    def infos(self) -> dict[str, TensorInfo]:
        return {key: self.file.info(key) for key in self.file.names()}

    def read(self, key: str) -> torch.Tensor:
        return self.file.tensor(key)

    def release(self, key: str) -> None:
        self.file.release(key)

    def reference(self, key: str) -> tuple[str, str] | None:
        return os.path.abspath(self.name), key

    def close(self) -> None:
        self.file.close()


class PickleSource(Source):
    """A ``torch.save`` state dict (``pytorch_model.bin``), memory-mapped when it is in the
    zip format; only tensors are read (``weights_only=True``: no code runs)."""

    def __init__(self, path: str) -> None:
        self.name = path
        self._state: dict[str, torch.Tensor] | None = None
        self._infos = {k: TensorInfo(v.dtype, tuple(v.shape)) for k, v in self._load().items()}
        self._state = None  # shapes known; the data is mapped again when read

    def _load(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            try:
                loaded = torch.load(self.name, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be mapped
                loaded = torch.load(self.name, map_location="cpu", weights_only=True)
            except Exception as error:
                raise CheckpointError(f"cannot read {self.name}: {error}") from None
            if not isinstance(loaded, dict):
                raise CheckpointError(
                    f"{self.name} holds a {type(loaded).__name__}, not a state dict"
                )
            self._state = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        return self._state

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, key: str) -> torch.Tensor:
        return self._load()[key]

    def close(self) -> None:
        self._state = None


class DistributedCheckpointSource(Source):
    """A torch.distributed.checkpoint folder (what a sharded ``save_state`` writes), read in
    this one process without a process group, one tensor at a time (shards written by
    several processes are reassembled)."""

    def __init__(self, folder: str, prefix: str | None = None) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.name = folder
        metadata = FileSystemReader(folder).read_metadata()
        raw = {
            key: TensorInfo(item.properties.dtype, tuple(item.size))
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
        if prefix is None:  # save_state stores the model under "model."
            prefix = "model." if raw and all(k.startswith("model.") for k in raw) else ""
        self.prefix = prefix
        self._infos = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        info = self._infos[key]
        tensor = torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": intended
            dcp.load(
                {self.prefix + key: tensor},
                storage_reader=FileSystemReader(self.name),
                no_dist=True,
            )
        return tensor


@dataclass
class Checkpoint:
    """The sources of one checkpoint, in reading order."""

    where: str
    sources: list[Source]

    def infos(self) -> dict[str, TensorInfo]:
        found: dict[str, TensorInfo] = {}
        for source in self.sources:
            found.update(source.infos())
        return found

    def close(self) -> None:
        for source in self.sources:
            source.close()


def open_checkpoint(checkpoint: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``checkpoint``: a file (``.safetensors``, ``.bin``, ``*.index.json``)
    or a folder holding one of the layouts in this module's docstring.

    Example::

        open_checkpoint("out/").infos()    # {name: TensorInfo(dtype, shape)}
    """
    path = os.fspath(checkpoint)
    if "://" in path:
        raise CheckpointError(
            f"{path}: big-model loading memory-maps local files; copy the checkpoint to a "
            "local disk first"
        )
    if os.path.isfile(path):
        if path.endswith(".json"):
            return _from_index(path)
        return Checkpoint(path, [_file_source(path)])
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    names = sorted(os.listdir(path))
    if ".metadata" in names:
        return Checkpoint(path, [DistributedCheckpointSource(path)])
    indexes = [n for n in names if n.endswith(".index.json")]
    preferred = [n for n in indexes if ".safetensors." in n] or indexes
    if len(preferred) > 1:
        raise CheckpointError(
            f"{path} holds several indexes ({', '.join(preferred)}); pass the one to load "
            "as the checkpoint"
        )
    if preferred:
        return _from_index(os.path.join(path, preferred[0]))
    for single in ("model.safetensors", "pytorch_model.bin"):
        if single in names:
            return Checkpoint(path, [_file_source(os.path.join(path, single))])
    sharded = os.path.join(path, "pytorch_model_fsdp_0")
    if os.path.isfile(os.path.join(sharded, ".metadata")):  # a sharded save_state
        return Checkpoint(path, [DistributedCheckpointSource(sharded, "model.")])
    singles = [n for n in names if n.endswith(".safetensors")]
    if len(singles) == 1:
        return Checkpoint(path, [_file_source(os.path.join(path, singles[0]))])
    raise CheckpointError(
        f"{path} holds no checkpoint this can read: expected model.safetensors, a "
        "*.index.json with its shards, pytorch_model.bin, or a torch.distributed.checkpoint "
        f"folder (.metadata); found {', '.join(names) or 'nothing'}"
    )


def _file_source(path: str) -> Source:
    if path.endswith(".safetensors"):
        return SafetensorsSource(path)
    return PickleSource(path)


def _from_index(index_path: str) -> Checkpoint:
    try:
        with open(index_path) as handle:
            index = json.load(handle)
        # transformers' {"metadata": ..., "weight_map": {...}}, or the bare name -> file map.
        weight_map: dict[str, str] = index.get("weight_map", index)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError
    except (ValueError, AttributeError, TypeError):
        raise CheckpointError(
            f"{index_path} is not a checkpoint index: it must map tensor names to files, as "
            'transformers\' {"weight_map": {"name": "file", ...}} or a plain {"name": "file"}'
        ) from None
    folder = os.path.dirname(index_path)
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise CheckpointError(
            f"{index_path} lists {', '.join(missing[:4])}, which {'is' if len(missing) == 1 else 'are'} "
            f"not in {folder or '.'} (an incomplete download or copy?)"
        )
    sources = [_file_source(os.path.join(folder, f)) for f in files]
    for source, name in zip(sources, files, strict=True):
        listed = {k for k, f in weight_map.items() if f == name}
        absent = sorted(listed - set(source.infos()))
        if absent:
            raise CheckpointError(f"{index_path} says {name} holds {absent[:4]}, but it does not")
    return Checkpoint(index_path, sources)
