"""Safe file formats: safetensors for tensors, ``torch.load(weights_only=True)`` for the rest.

State dicts with tied weights (several names, one storage) are saved once; the other names
are recorded as aliases in the safetensors metadata and restored on load.

Example::

    data = tensors_to_bytes(model.state_dict())
    model.load_state_dict(tensors_from_bytes(data))
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..runtime import xla
from .storage import Storage

_ALIASES_KEY = "slipstream_aliases"


def prepare_tensors(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU tensors with shared storage kept once; returns (tensors, aliases).
    XLA tensors are copied to the CPU first (ties among them are not detected)."""
    if xla.xla_loaded():
        state = xla.to_cpu(dict(state))
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor; "
                "safetensors stores tensors only"
            )
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        value = tensor.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        unique[name] = value.to("cpu").contiguous()
    return unique, aliases


def tensors_to_bytes(
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    from safetensors.torch import save

    tensors, aliases = prepare_tensors(state, dtype)
    extra = dict(metadata or {})
    if aliases:
        extra[_ALIASES_KEY] = json.dumps(aliases)
    return bytes(save(tensors, metadata=extra or None))


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload (an 8-byte length, then a JSON header)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    tensors = load(data)
    for alias, original in json.loads(_metadata(data).get(_ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[original]
    return tensors


def save_tensors(storage: Storage, path: str, state: Mapping[str, torch.Tensor], **kw: Any) -> None:
    """Write a safetensors file (directly on local disks, as bytes elsewhere)."""
    if storage.is_local:
        from safetensors.torch import save_file

        tensors, aliases = prepare_tensors(state, kw.get("dtype"))
        metadata = dict(kw.get("metadata") or {})
        if aliases:
            metadata[_ALIASES_KEY] = json.dumps(aliases)
        storage.makedirs(storage.parent(path))
        save_file(tensors, path, metadata=metadata or None)
    else:
        storage.write_bytes(path, tensors_to_bytes(state, kw.get("dtype"), kw.get("metadata")))


def load_tensors(storage: Storage, path: str) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_tensors` (aliases restored)."""
    from safetensors import safe_open

    if storage.is_local:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        for alias, original in json.loads(metadata.get(_ALIASES_KEY, "{}")).items():
            tensors[alias] = tensors[original]
        return tensors
    return tensors_from_bytes(storage.read_bytes(path))


def save_object(storage: Storage, path: str, obj: Any) -> None:
    """``torch.save`` an object made of tensors, numbers, strings, lists and dicts (XLA
    tensors are written as CPU tensors)."""
    if xla.xla_loaded():
        obj = xla.to_cpu(obj)
    if storage.is_local:
        storage.makedirs(storage.parent(path))
        torch.save(obj, path)
        return
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    storage.write_bytes(path, buffer.getvalue())


def load_object(storage: Storage, path: str) -> Any:
    """Load what :func:`save_object` wrote, with ``weights_only=True`` (no code runs)."""
    try:
        if storage.is_local:
            # Not memory-mapped: optimizers keep loaded tensors as they are, and a mapping
            # would tie their state to a checkpoint file that rotation may delete.
            return torch.load(path, map_location="cpu", weights_only=True)
        return torch.load(storage.readable(path), map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(
            f"{storage.url(path)} holds types torch.load(weights_only=True) refuses ({error}); "
            "checkpointed state must be tensors, numbers, strings, lists and dicts"
        ) from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"10GB"``, ``"500MiB"``."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"cannot read size {size!r}; write it like '10GB', '500MB' or 1000000")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "B").upper()])
