"""Walk nested batches: tuples, lists, namedtuples, mappings and dataclasses of tensors.

Example::

    batch = {"x": torch.ones(2, 3), "meta": [torch.zeros(2)]}
    send_to_device(batch, torch.device("cpu"))
    map_tensors(lambda t: t * 2, batch)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def map_structure(fn: Callable[[Any], Any], data: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """Apply ``fn`` to every leaf for which ``is_leaf`` holds, keeping the structure."""
    if is_leaf(data):
        return fn(data)
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: map_structure(fn, v, is_leaf) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_structure(fn, v, is_leaf) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_structure(fn, v, is_leaf) for v in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        rebuilt = copy.copy(data)
        for f in dataclasses.fields(data):
            object.__setattr__(rebuilt, f.name, map_structure(fn, getattr(data, f.name), is_leaf))
        return rebuilt
    return data


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor in ``data``; other leaves are kept unchanged."""
    return map_structure(fn, data, is_tensor)


def tensor_leaves(data: Any) -> list[torch.Tensor]:
    """Every tensor in ``data`` in a deterministic (depth-first) order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, data)
    return found


def replace_tensors(data: Any, replacements: list[torch.Tensor]) -> Any:
    """Rebuild ``data`` with its tensors replaced, in :func:`tensor_leaves` order."""
    iterator = iter(replacements)
    return map_tensors(lambda _: next(iterator), data)


def describe(data: Any) -> Any:
    """A comparable, printable summary: structure with (shape, dtype) in place of tensors."""
    if isinstance(data, torch.Tensor):
        return ("Tensor", tuple(data.shape), str(data.dtype).replace("torch.", ""))
    if isinstance(data, Mapping):
        return {str(k): describe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [describe(v) for v in data]
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return {f.name: describe(getattr(data, f.name)) for f in dataclasses.fields(data)}
    return type(data).__name__


def _tensors_on(items: list[Any] | tuple[Any, ...], device: torch.device) -> bool:
    # A plain loop, not all(<generator>): no generator frame resumed per item, every batch.
    for item in items:  # noqa: SIM110
        if type(item) is not torch.Tensor or item.device != device:
            return False
    return True


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor (and every object with a ``.to`` method) in ``data`` to ``device``."""
    if isinstance(data, (list, tuple)) and _tensors_on(data, torch.device(device)):
        # The common batch, a flat list/tuple of tensors already in place (CPU training), is
        # returned as is: this runs for every batch.
        return data

    def is_movable(value: Any) -> bool:
        return isinstance(value, torch.Tensor) or (
            not isinstance(value, (Mapping, list, tuple, type))
            and callable(getattr(value, "to", None))
            and not dataclasses.is_dataclass(value)
        )

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=non_blocking)
        try:
            return value.to(device, non_blocking=non_blocking)
        except TypeError:
            return value.to(device)

    return map_structure(move, data, is_movable)
