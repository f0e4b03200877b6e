"""Load a checkpoint into a model, tensor by tensor, each straight to the device it belongs on.

Everything is checked before the model changes: every weight of the model must be in the
checkpoint (a tied weight through any of its names), every tensor of the checkpoint must
belong to the model, shapes must agree, and the devices must exist. Then each tensor is
read from the memory-mapped file, copied once to its device (converted to ``dtype``), and
its pages are handed back — peak memory is what stays loaded plus one tensor. Tensors the
device map sends to ``"disk"`` are not loaded at all: the offload folder's index points at
the checkpoint's own safetensors files (other formats are copied into the folder).

Example::

    with init_empty_weights():
        model = MyModel()
    load_checkpoint_in_model(model, "checkpoint/", device_map={"": "cpu"})
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ..checkpoint.commit import CheckpointError
from .budgets import Device, DeviceLike, DeviceMapError, torch_device
from .device_map import assign_tensors, check_device_map, is_offloaded, main_device
from .offload import OffloadEntry, OffloadWriter, read_index, write_index
from .sources import Checkpoint, TensorInfo, open_checkpoint
from .tensors import (
    all_tensor_names,
    assign_module_tensor,
    get_module_tensor,
    non_persistent_buffers,
    parameter_like,
    resolve_dtype,
    tie_groups,
)

logger = logging.getLogger(__name__)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    strict: bool = False,
) -> None:
    """Read ``checkpoint`` into ``model``, each tensor onto its device in ``device_map``.

    ``checkpoint`` is a safetensors file, a folder with ``*.index.json`` and its shards
    (transformers' ``save_pretrained``, slipstream's ``save_model``), a ``.bin`` state dict,
    or a sharded ``save_state`` checkpoint. Without ``device_map`` tensors stay on their
    device (the CPU for meta tensors). Tensors mapped to ``"disk"`` are recorded in
    ``offload_folder`` for :func:`dispatch_model` and stay on the meta device.

    Missing weights (of tensors that hold no values yet) and wrong shapes raise a
    :class:`CheckpointError` before anything is loaded. Checkpoint keys the model lacks are
    ignored, and tensors the checkpoint lacks keep their values, each with a logged warning
    (as Accelerate does); ``strict=True`` refuses both.
    ``offload_state_dict`` is accepted for Accelerate's signature: no state dict is ever
    held here.

    Example::

        load_checkpoint_in_model(model, "llama/", device_map={"model": "cpu", "lm_head": "disk"},
                                 offload_folder="offload/")
    """
    del offload_state_dict
    resolved = resolve_dtype(dtype)
    checked = (
        check_device_map(model, device_map, must_exist=True) if device_map is not None else None
    )
    # Shapes and dtypes only: holding the tensors themselves would keep a model that already
    # has weights alive next to the loaded one.
    tensors = {name: _Layout(t) for name, t in all_tensor_names(model).items()}
    placements = _placements(model, tensors, checked, offload_buffers)
    disk = [name for name, device in placements.items() if device == "disk"]
    if disk and offload_folder is None:
        raise DeviceMapError(
            f"device_map puts {_listing(disk)} on 'disk'; pass offload_folder= (a folder "
            "for the offload index and any weights that must be copied there)"
        )
    meta_buffers = sorted(
        n
        for n in non_persistent_buffers(model)
        if tensors[n].is_meta and placements.get(n) != "disk"
    )
    if meta_buffers:
        raise CheckpointError(
            f"{_listing(meta_buffers)} {'is a buffer' if len(meta_buffers) == 1 else 'are buffers'} "
            "on the meta device that no checkpoint holds (state_dict leaves them out); build "
            "the model with init_empty_weights(include_buffers=False) so they are computed"
        )
    opened = open_checkpoint(checkpoint)
    try:
        feeds = _match(model, tensors, opened, strict)
        _stream(model, tensors, opened, feeds, placements, resolved, offload_folder)
    finally:
        opened.close()


class _Layout:
    """What loading needs to know about one of the model's tensors."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.is_meta = tensor.is_meta
        self.device = tensor.device


def _placements(
    model: nn.Module,
    tensors: Mapping[str, _Layout],
    device_map: Mapping[str, Device] | None,
    offload_buffers: bool,
) -> dict[str, Device]:
    """The device each persistent tensor is loaded to (``"disk"``: recorded, not loaded)."""
    persistent = set(model.state_dict(keep_vars=True))
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    if device_map is None:
        return {
            name: ("cpu" if t.is_meta else _device_key(t.device))
            for name, t in tensors.items()
            if name in persistent
        }
    assignment = assign_tensors(model, device_map)
    main = main_device(list(device_map.values()))
    placements: dict[str, Device] = {}
    for name in tensors:
        if name not in persistent or name not in assignment:
            continue
        device = device_map[assignment[name]]
        if name in buffers and not offload_buffers and is_offloaded(device, main):
            device = main  # buffers of offloaded modules stay where the module runs
        placements[name] = device
    return placements


def _device_key(device: torch.device) -> Device:
    if device.type == "cuda":
        return device.index or 0
    return device.type


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    declared = getattr(model, attribute, None) or []
    return [re.compile(p) for p in declared if isinstance(p, str)]


def _ignored(name: str, patterns: Iterable[re.Pattern[str]]) -> bool:
    return any(p.search(name) for p in patterns)


def _match(
    model: nn.Module, tensors: Mapping[str, _Layout], checkpoint: Checkpoint, strict: bool
) -> dict[str, list[str]]:
    """Checkpoint key -> the model names it fills; raises, naming every mismatch, unless
    the checkpoint fits."""
    infos: dict[str, TensorInfo] = checkpoint.infos()
    expected = list(model.state_dict(keep_vars=True))
    ties = tie_groups(model)
    transient = non_persistent_buffers(model)
    # transformers models list checkpoint keys they tolerate (regular expressions).
    may_miss = _patterns(model, "_keys_to_ignore_on_load_missing")
    may_add = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    feeds: dict[str, list[str]] = {}
    missing: list[str] = []
    kept: list[str] = []
    for name in expected:
        group = ties.get(name, (name,))
        key = next((n for n in group if n in infos), None)
        if key is not None:
            feeds.setdefault(key, []).append(name)
        elif not strict and not tensors[name].is_meta:
            kept.append(name)
        elif not _ignored(name, may_miss):
            missing.append(name)
    known = set(expected) | transient
    # A key naming a non-persistent buffer (rotary frequencies in older checkpoints) is
    # neither loaded nor unexpected: the model computes that buffer itself.
    unexpected = [k for k in infos if k not in known and not _ignored(k, may_add)]
    wrong = [
        f"{name} {infos[key].shape} in the checkpoint vs {tuple(tensors[name].shape)}"
        for key, names in feeds.items()
        for name in names
        if infos[key].shape != tuple(tensors[name].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {_listing(missing)}")
    if wrong:
        problems.append(f"different shapes: {'; '.join(wrong[:6])}")
    if unexpected and strict:
        problems.append(f"unexpected {_listing(unexpected)} (strict=False ignores these)")
    if not feeds and expected and infos and not problems:
        # Not even strict=False loads anything from a checkpoint of another model.
        problems.append(f"missing {_listing(expected)}")
    if problems:
        if not feeds:
            problems.append("no key in common: is it a checkpoint of another model?")
        raise CheckpointError(
            f"the checkpoint {checkpoint.where} does not fit {type(model).__name__}: "
            f"{'; '.join(problems)}. Nothing was loaded"
        )
    if unexpected:
        logger.warning(
            "Some weights of the checkpoint %s were not used when loading %s: %s, which it "
            "does not have, are ignored (strict=True refuses them)",
            checkpoint.where,
            type(model).__name__,
            _listing(unexpected),
        )
    if kept:
        logger.warning(
            "%s lacks %s; they keep their current values (strict=True refuses this)",
            checkpoint.where,
            _listing(kept),
        )
    return feeds


def _stream(
    model: nn.Module,
    tensors: Mapping[str, _Layout],
    checkpoint: Checkpoint,
    feeds: Mapping[str, list[str]],
    placements: Mapping[str, Device],
    dtype: torch.dtype | None,
    offload_folder: str | os.PathLike[str] | None,
) -> None:
    """Copy every fed tensor to its device; record (or copy) the disk ones."""

    def target_dtype(name: str, stored: torch.dtype) -> torch.dtype:
        current = tensors[name].dtype
        if not stored.is_floating_point or not current.is_floating_point:
            return stored
        return dtype if dtype is not None else current

    folder = os.fspath(offload_folder) if offload_folder is not None else None
    infos = checkpoint.infos()
    owners = {key: source for source in checkpoint.sources for key in source.names()}
    entries: dict[str, OffloadEntry] = {}
    copies: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # checkpoint key -> layout
    for key, names in feeds.items():
        for name in (n for n in names if placements.get(n) == "disk"):
            wanted = target_dtype(name, infos[key].dtype)
            reference = owners[key].reference(key)
            if reference is not None:
                entries[name] = OffloadEntry(reference[0], reference[1], wanted)
            else:
                copies.setdefault(key, (wanted, infos[key].shape))
    origin = os.path.abspath(checkpoint.where)
    writer = OffloadWriter(folder, copies, origin) if copies and folder is not None else None
    try:
        for source in checkpoint.sources:
            for key in source.names():
                names = [n for n in feeds.get(key, ()) if n in placements]
                if not names:
                    continue
                value = source.read(key)
                if writer is not None and key in copies:
                    writer.write(key, value)
                _place(model, names, value, placements, target_dtype)
                source.release(key)
            source.close()
        if writer is not None:
            path = writer.finish()
            for key, names in feeds.items():
                if key in copies:
                    entries.update(
                        {
                            n: OffloadEntry(path, key, None)
                            for n in names
                            if placements.get(n) == "disk"
                        }
                    )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if folder is not None and entries:
        os.makedirs(folder, exist_ok=True)
        write_index(folder, {**_still_valid(folder, entries), **entries})


def _still_valid(folder: str, fresh: Mapping[str, OffloadEntry]) -> dict[str, OffloadEntry]:
    """Entries of an earlier index that this load does not replace and whose files exist
    (another model offloaded into the same folder keeps working)."""
    return {
        name: entry
        for name, entry in read_index(folder).items()
        if name not in fresh and os.path.isfile(entry.file)
    }


def _place(
    model: nn.Module,
    names: list[str],
    value: torch.Tensor,
    placements: Mapping[str, Device],
    target_dtype: Callable[[str, torch.dtype], torch.dtype],
) -> None:
    """Put ``value`` at every name it feeds: one tensor per device, so names tied in the
    model stay tied wherever they share a device. Disk names get an empty (meta) tensor."""
    copies: dict[tuple[Device, torch.dtype], torch.Tensor] = {}
    parameters: dict[tuple[Device, torch.dtype], nn.Parameter] = {}
    for name in names:
        device, old = placements[name], get_module_tensor(model, name)
        wanted = target_dtype(name, value.dtype)
        if device == "disk":
            empty = torch.empty(old.shape, dtype=wanted, device="meta")
            new = parameter_like(old, empty) if isinstance(old, nn.Parameter) else empty
            assign_module_tensor(model, name, new)
            continue
        where = (device, wanted)
        if where not in copies:
            with torch.no_grad():
                # A copy, never a view: the source's pages are released next.
                copies[where] = torch.empty(value.shape, dtype=wanted, device=torch_device(device))
                copies[where].copy_(value)
        if isinstance(old, nn.Parameter):
            if where not in parameters:
                parameters[where] = parameter_like(old, copies[where])
            assign_module_tensor(model, name, parameters[where])
        else:
            assign_module_tensor(model, name, copies[where])
