"""Devices and memory budgets: what ``max_memory`` and device-map values may name.

A device is a GPU index (``0``, also written ``"cuda:0"`` or ``torch.device("cuda", 0)``),
``"mps"``, ``"cpu"`` or ``"disk"``. Budgets are bytes or strings such as ``"10GiB"``/``"10GB"``.
A device this machine does not have is an error, never a silent fallback.

Example::

    get_max_memory({0: "10GiB", "cpu": "30GiB"})   # {0: 10737418240, 'cpu': 32212254720}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ..checkpoint.serialization import parse_size
from .tensors import compute_module_sizes, describe_bytes, resolve_dtype

if TYPE_CHECKING:
    from torch import nn

#: A normalised device: a GPU index, or "mps", "cpu", "disk".
Device = int | str
DeviceLike = int | str | torch.device


class DeviceMapError(ValueError):
    """A device map or memory budget names something this model or machine does not have,
    or the budgets cannot run the model."""


def available_devices() -> list[Device]:
    """Every device this machine offers, in placement order (GPUs, mps, cpu, disk)."""
    found: list[Device] = list(range(torch.cuda.device_count()))
    if _mps_available():
        found.append("mps")
    return [*found, "cpu", "disk"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def normalize_device(device: DeviceLike, where: str = "device", must_exist: bool = True) -> Device:
    """``0`` for ``0``, ``"cuda:0"`` or ``torch.device("cuda", 0)``; ``"cpu"``, ``"mps"``
    and ``"disk"`` as they are. Raises :class:`DeviceMapError` naming ``where`` for what is
    no device, or (``must_exist``: weights go there now) one this machine does not have;
    plans for another machine pass ``must_exist=False``."""
    normalised: Device | None = None
    if isinstance(device, bool):
        normalised = None
    elif isinstance(device, int):
        normalised = device
    elif isinstance(device, (str, torch.device)):
        text = str(device)
        if text in ("cpu", "disk", "mps"):
            normalised = text
        elif text == "cuda":
            normalised = torch.cuda.current_device() if torch.cuda.is_available() else 0
        elif text.startswith("cuda:") and text[5:].isdecimal():
            normalised = int(text[5:])
        elif text.isdecimal():
            normalised = int(text)
    present = available_devices()
    if normalised is not None and not must_exist:
        return normalised
    if normalised is None or normalised not in present:
        gpus = torch.cuda.device_count()
        have = f"GPUs 0..{gpus - 1}" if gpus else "no GPU"
        raise DeviceMapError(
            f"{where} names device {device!r}, which this machine does not have ({have}); "
            f"use one of {present} (GPU indices as ints or 'cuda:N')"
        )
    return normalised


def torch_device(device: Device) -> torch.device:
    """The torch device that runs or holds weights placed on ``device`` (not ``"disk"``)."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _order(devices: Mapping[Device, int]) -> dict[Device, int]:
    gpus: list[Device] = sorted(d for d in devices if isinstance(d, int))
    named: list[Device] = [d for d in ("mps", "cpu", "disk") if d in devices]
    return {d: devices[d] for d in [*gpus, *named]}


def available_cpu_memory() -> int:
    """Bytes of RAM available to new allocations now (``MemAvailable`` on Linux)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def get_max_memory(
    max_memory: Mapping[DeviceLike, int | str] | None = None,
) -> dict[Device, int]:
    """Budgets in bytes per device, GPUs first, then ``mps``, ``cpu``, ``disk``.

    Without ``max_memory``: the free memory of every GPU and the available RAM. With it:
    the devices it names (strings such as ``"10GiB"`` converted), checked to exist here.

    Example::

        get_max_memory({0: "10GiB", "cpu": "30GiB"})
    """
    if max_memory is None:
        found: dict[Device, int] = {}
        for index in range(torch.cuda.device_count()):
            found[index] = int(torch.cuda.mem_get_info(index)[0])
        if _mps_available():
            found["mps"] = available_cpu_memory()  # unified memory: one budget, not two
        else:
            found["cpu"] = available_cpu_memory()
        return _order(found)
    if not isinstance(max_memory, Mapping):
        raise DeviceMapError(
            f"max_memory must be a dict of device -> budget such as {{0: '10GiB', 'cpu': "
            f"'30GiB'}}; got {type(max_memory).__name__}"
        )
    budgets: dict[Device, int] = {}
    for key, value in max_memory.items():
        # Budgets may describe another machine (a plan made here for a GPU server).
        device = normalize_device(key, f"max_memory key {key!r}", must_exist=False)
        try:
            size = parse_size(value) if isinstance(value, (int, str)) else int(value)
        except (ValueError, TypeError):
            raise DeviceMapError(
                f"max_memory[{key!r}] = {value!r} is not a size; write bytes or e.g. '10GiB'"
            ) from None
        if size < 0:
            raise DeviceMapError(f"max_memory[{key!r}] = {value!r} is negative")
        if device in budgets:
            raise DeviceMapError(f"max_memory names device {device!r} twice (as {key!r} too)")
        budgets[device] = size
    return _order(budgets)


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[DeviceLike, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """Budgets that spread ``model`` evenly over the GPUs instead of filling GPU 0 first.

    Each GPU but the last is capped at its share of the model plus a margin (the largest
    unsplittable block, or 1.25 x the mean leaf module); ``low_zero`` puts as little as
    possible on GPU 0, leaving it room for generation. Without GPUs the budgets are
    returned unchanged.

    Example::

        infer_auto_device_map(model, max_memory=get_balanced_memory(model, {0: "8GiB", 1: "8GiB"}))
    """
    budgets = get_max_memory(max_memory)
    gpus = [d for d, size in budgets.items() if isinstance(d, int) and size > 0]
    if len(gpus) < 2:
        return budgets
    sizes = compute_module_sizes(model, resolve_dtype(dtype), special_dtypes)
    total = sizes[""]
    share = total // (len(gpus) - 1 if low_zero else len(gpus))
    classes = set(no_split_module_classes or []) | declared_no_split(model)
    blocks = [
        sizes.get(name, 0) for name, m in model.named_modules() if type(m).__name__ in classes
    ]
    leaves = [
        sizes.get(name, 0) for name, m in model.named_modules() if name and not list(m.children())
    ]
    mean_leaf = sum(leaves) // max(len(leaves), 1)
    share += int(1.25 * max([mean_leaf, *blocks]))
    for gpu in gpus[:-1]:
        if not (low_zero and gpu == gpus[0]):
            budgets[gpu] = min(share, budgets[gpu])
    if low_zero:
        others = sum(budgets[g] for g in gpus[1:])
        budgets[gpus[0]] = min(max(0, total - others), budgets[gpus[0]])
    return budgets


def declared_no_split(model: nn.Module) -> set[str]:
    """The block classes a transformers model declares unsplittable (``_no_split_modules``)."""
    declared = getattr(model, "_no_split_modules", None)
    if isinstance(declared, str):
        return {declared}
    if declared is None:
        return set()
    try:
        return {str(name) for name in declared}
    except TypeError:
        return set()


def describe_budget(device: Device, size: int) -> str:
    return f"max_memory[{device!r}] = {describe_bytes(size)}"
