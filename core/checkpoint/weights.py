"""Model weights as Hugging Face-style safetensors: one file, or shards plus an index.

Example::

    save_weights(state_dict, "out/", max_shard_size="2GB", dtype=torch.bfloat16)
    model.load_state_dict(load_weights("out/"))
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from .commit import Location, publish
from .serialization import load_object, load_tensors, parse_size, save_object, save_tensors
from .storage import Storage

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    itemsize = (
        torch.empty((), dtype=dtype).element_size()
        if dtype is not None and tensor.is_floating_point()
        else tensor.element_size()
    )
    return tensor.numel() * itemsize


def plan_shards(
    state: Mapping[str, torch.Tensor], max_bytes: int, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Group tensor names into shards of at most ``max_bytes`` (a bigger tensor stands alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = _nbytes(tensor, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards if shards[0] else []


def save_weights(
    state: Mapping[str, torch.Tensor],
    destination: str,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> list[str]:
    """Write ``state`` into the folder ``destination``; returns the file names written.

    One ``model.safetensors`` when it fits in ``max_shard_size``, otherwise
    ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``. With
    ``safe_serialization=False`` the same layout uses ``pytorch_model*.bin``. ``dtype``
    casts floating-point tensors (e.g. ``torch.bfloat16`` for 16-bit weights).
    """
    storage = Storage.for_url(destination)
    folder = storage.root
    storage.makedirs(folder)
    shards = plan_shards(state, parse_size(max_shard_size), dtype)
    single, index_name = (
        (SAFE_WEIGHTS, SAFE_INDEX)
        if safe_serialization
        else (
            PICKLE_WEIGHTS,
            PICKLE_INDEX,
        )
    )
    stem, suffix = single.rsplit(".", 1)
    names = (
        [single]
        if len(shards) <= 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{suffix}" for i in range(len(shards))]
    )
    for old in _stale(storage.listdir(folder), names, safe_serialization):
        path = storage.join(folder, old)
        if not storage.isdir(path):
            storage.remove(path)
    weight_map: dict[str, str] = {}
    total = 0
    for name, keys in _progress(zip(names, shards or [[]], strict=True), progress, len(names)):
        part = {key: state[key] for key in keys}
        total += sum(_nbytes(t, dtype) for t in part.values())
        path = storage.join(folder, name)
        if safe_serialization:
            save_tensors(storage, path, part, dtype=dtype, metadata={"format": "pt"})
        else:
            save_object(storage, path, _cast(part, dtype))
        weight_map.update(dict.fromkeys(keys, name))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        storage.write_text(storage.join(folder, index_name), json.dumps(index, indent=2))
        names.append(index_name)
    return names


def _stale(present: list[str], names: list[str], safe_serialization: bool) -> list[str]:
    """Files of an earlier, differently sharded save that this one does not overwrite and
    that loaders would read instead of it: shards named like this save's
    (``model-00002-of-00003.safetensors``), the single file when this save is sharded, and
    the index files (an index is read before single files, of either format). Nothing else
    in the folder is touched (``model_card.md``, ``pytorch_model_fsdp_0/``...)."""
    single = SAFE_WEIGHTS if safe_serialization else PICKLE_WEIGHTS
    stem, suffix = single.rsplit(".", 1)
    shard = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(suffix)}")
    doomed = {single, SAFE_INDEX, PICKLE_INDEX}
    return [
        name
        for name in present
        if name not in names and (name in doomed or shard.fullmatch(name) is not None)
    ]


def export_weights(
    state: Mapping[str, torch.Tensor],
    destination: str,
    *,
    max_shard_size: int | str = "10GB",
    dtype: torch.dtype | None = None,
) -> list[str]:
    """:func:`save_weights` as one atomic replacement of the folder ``destination``.

    On local disks the files go to a hidden sibling folder that is renamed over
    ``destination`` once complete (a crash leaves the previous export whole); on object
    stores, which cannot rename folders, the shards are written first and the index (or the
    single file) that readers open is one object written last. The folder belongs to the
    export: anything else in it is replaced.

    Example::

        export_weights(model.state_dict(), "s3://bucket/run/weights", dtype=torch.bfloat16)
    """
    storage = Storage.for_url(destination)
    if not storage.is_local:
        return save_weights(state, destination, max_shard_size=max_shard_size, dtype=dtype)
    location = Location(storage, storage.root, uuid.uuid4().hex[:12])
    storage.makedirs(location.staging)
    try:
        names = save_weights(
            state, storage.url(location.staging), max_shard_size=max_shard_size, dtype=dtype
        )
    except BaseException:
        storage.remove(location.staging)
        raise
    publish(location)
    return names


def _progress(items: Any, enabled: bool, total: int) -> Any:
    """A tqdm bar over ``items`` when asked and tqdm is installed."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    from ..runtime.progress import bar_options

    return tqdm(items, **bar_options({"total": total, "desc": "writing weights", "unit": "file"}))


def _cast(part: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return {k: v.detach().cpu() for k, v in part.items()}
    return {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu()
        for k, v in part.items()
    }


def load_weights(source: str) -> dict[str, torch.Tensor]:
    """Read a folder (or single file) written by :func:`save_weights` or Hugging Face."""
    storage = Storage.for_url(source)
    path = storage.root
    if not storage.isdir(path):
        return _load_file(storage, path)
    present = set(storage.listdir(path))
    for index_name in (SAFE_INDEX, PICKLE_INDEX):
        if index_name in present:
            index: dict[str, Any] = json.loads(storage.read_text(storage.join(path, index_name)))
            tensors: dict[str, torch.Tensor] = {}
            for name in sorted(set(index["weight_map"].values())):
                tensors.update(_load_file(storage, storage.join(path, name)))
            return tensors
    for single in (SAFE_WEIGHTS, PICKLE_WEIGHTS):
        if single in present:
            return _load_file(storage, storage.join(path, single))
    raise FileNotFoundError(
        f"{storage.url(path)} holds no model weights: expected {SAFE_WEIGHTS}, {SAFE_INDEX}, "
        f"{PICKLE_WEIGHTS} or {PICKLE_INDEX}; found {', '.join(sorted(present)) or 'nothing'}"
    )


def _load_file(storage: Storage, path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return load_tensors(storage, path)
    loaded = load_object(storage, path)
    if not isinstance(loaded, dict):
        raise ValueError(f"{storage.url(path)} does not hold a state dict")
    return loaded
