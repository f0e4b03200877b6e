"""Device maps: which device holds each part of a model, planned from memory budgets or given.

A device map maps module (or tensor) names to devices; the most specific name covering a
tensor decides where it goes, and ``""`` is the whole model. :func:`infer_auto_device_map`
fills the GPUs in order, then the CPU, then the disk, never splitting the blocks listed in
``no_split_module_classes`` (a transformers model's own ``_no_split_modules`` are added).
While anything is offloaded the execution device keeps room for the largest block, which is
loaded there whole to run.

Example::

    device_map = infer_auto_device_map(model, max_memory={"cpu": "2GiB"},
                                       no_split_module_classes=["LlamaDecoderLayer"])
    # {'model.embed_tokens': 'cpu', 'model.layers.0': 'cpu', ..., 'lm_head': 'disk'}
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .budgets import (
    Device,
    DeviceLike,
    DeviceMapError,
    declared_no_split,
    describe_budget,
    get_balanced_memory,
    get_max_memory,
    normalize_device,
)
from .tensors import (
    all_tensor_names,
    class_names,
    describe_bytes,
    named_module_tensors,
    resolve_dtype,
    tensor_nbytes,
)

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

Unit = tuple[str, Any]  # (name, nn.Module or tensor)


def no_split_classes(model: nn.Module, requested: str | list[str] | None) -> set[str]:
    """``requested`` (checked against the model's classes) plus the model's declared ones."""
    names = [requested] if isinstance(requested, str) else list(requested or [])
    present = class_names(model)
    unknown = sorted(set(names) - present)
    if unknown:
        raise DeviceMapError(
            f"no_split_module_classes names {unknown}, but {type(model).__name__} has no module "
            f"of that class; its classes: {', '.join(sorted(present))}"
        )
    return set(names) | declared_no_split(model)


def main_device(devices: list[Device]) -> Device:
    """Where offloaded weights run: the first GPU (or mps), else the CPU."""
    for device in devices:
        if device not in ("cpu", "disk"):
            return device
    return "cpu"


def is_offloaded(device: Device, main: Device) -> bool:
    """True when weights on ``device`` must be brought to ``main`` to run."""
    return device == "disk" or (device == "cpu" and main != "cpu")


class _Planner:
    """One pass of the greedy placement over a model's units."""

    def __init__(
        self,
        model: nn.Module,
        budgets: dict[Device, int],
        no_split: set[str],
        dtype: torch.dtype | None,
        special: dict[str, torch.dtype | None],
        verbose: bool,
    ) -> None:
        self.model = model
        self.budgets = budgets
        self.no_split = no_split
        self.verbose = verbose
        self.devices: list[Device] = [*budgets, *([] if "disk" in budgets else ["disk"])]
        self.main = main_device(self.devices)
        # Devices that keep room for an offloaded block: the one it runs on and, with GPUs,
        # the CPU it passes through on its way from the disk.
        self.reserving = {self.main, "cpu"} if self.main != "cpu" else {"cpu"}
        self.size_of: dict[int, int] = {}
        for name, tensor in named_module_tensors(model, recurse=True):
            self.size_of[id(tensor)] = tensor_nbytes(tensor, special.get(name, dtype))
        self._largest: dict[str, tuple[int, str]] = {}

    # -- units ---------------------------------------------------------------------------------
    def tensors(self, unit: Unit) -> list[torch.Tensor]:
        _, obj = unit
        if isinstance(obj, torch.Tensor):
            return [obj]
        return [t for _, t in named_module_tensors(obj, recurse=True)]

    def splittable(self, unit: Unit) -> bool:
        _, obj = unit
        return (
            isinstance(obj, nn.Module)
            and type(obj).__name__ not in self.no_split
            and next(obj.children(), None) is not None
        )

    @staticmethod
    def children(unit: Unit) -> list[Unit]:
        name, module = unit
        prefix = f"{name}." if name else ""
        parts: list[Unit] = [
            *module.named_parameters(recurse=False),
            *module.named_children(),
            *module.named_buffers(recurse=False),
        ]
        return [(prefix + n, obj) for n, obj in parts]

    def size(self, unit: Unit) -> int:
        return sum(
            self.size_of.get(id(t), 0) for t in {id(t): t for t in self.tensors(unit)}.values()
        )

    def largest_block(self, unit: Unit) -> tuple[int, str]:
        """(bytes, name) of the largest part of ``unit`` that is never split."""
        name, _ = unit
        if name not in self._largest:
            if self.splittable(unit):
                found = max((self.largest_block(c) for c in self.children(unit)), default=(0, name))
            else:
                found = (self.size(unit), name)
            self._largest[name] = found
        return self._largest[name]

    # -- placement -----------------------------------------------------------------------------
    def run(self, reserve: bool) -> dict[str, Device]:
        queue: list[Unit] = self.children(("", self.model))
        placed: dict[Device, set[int]] = {d: set() for d in self.devices}
        used: dict[Device, int] = dict.fromkeys(self.devices, 0)
        plan: dict[str, Device] = {}
        index = 0
        while queue:
            unit = queue.pop(0)
            device = self.devices[index]
            fresh = {id(t): t for t in self.tensors(unit) if id(t) not in placed[device]}
            cost = sum(self.size_of.get(i, 0) for i in fresh)
            capacity = math.inf if device == "disk" else self.budgets[device]
            if reserve and device in self.reserving:
                capacity -= max(self.largest_block(u)[0] for u in [unit, *queue])
            if used[device] + cost <= capacity:
                plan[unit[0]] = device
                used[device] += cost
                placed[device].update(fresh)
                if self.verbose:
                    print(f"{unit[0] or '(root)'}: {describe_bytes(cost)} on {device!r}")
                continue
            if self.splittable(unit):
                queue = self.children(unit) + queue
                continue
            index += 1
            queue.insert(0, unit)
        return plan

    def offloaded(self, plan: dict[str, Device]) -> list[str]:
        return [name for name, device in plan.items() if is_offloaded(device, self.main)]


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[DeviceLike, int | str] | None = None,
    no_split_module_classes: str | list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
) -> dict[str, Device]:
    """Plan where each part of ``model`` goes: GPUs in order, then the CPU, then ``"disk"``.

    Works on a model built under ``init_empty_weights`` (sizes come from shapes and
    dtypes; ``dtype`` is the one weights will be loaded in). Blocks of
    ``no_split_module_classes`` — and of a transformers model's ``_no_split_modules`` — are
    kept whole on one device. When anything is offloaded (to the CPU while GPUs run, or to
    the disk) the execution device keeps room for the largest block; a budget too small
    for that block is a :class:`DeviceMapError` naming it.

    Buffers of offloaded modules stay on the execution device: a warning says when they do
    not fit there (``offload_buffers=True`` loads them with their module instead).

    Example::

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        infer_auto_device_map(model, max_memory={0: "10GiB", "cpu": "30GiB"})
    """
    budgets = get_max_memory(max_memory)
    resolved = resolve_dtype(dtype)
    special = {k: resolve_dtype(v) for k, v in (special_dtypes or {}).items()}
    planner = _Planner(
        model, budgets, no_split_classes(model, no_split_module_classes), resolved, special, verbose
    )
    plan = planner.run(reserve=False)
    if planner.offloaded(plan):
        # Something runs from elsewhere: plan again keeping room to bring its largest block in.
        plan = planner.run(reserve=True)
        _check_room_for_blocks(planner, plan)
        if not offload_buffers:
            _check_room_for_buffers(planner, plan)
    return clean_device_map(model, plan) if clean_result else plan


def _check_room_for_buffers(planner: _Planner, plan: dict[str, Device]) -> None:
    """Offloaded modules keep their buffers on the execution device (unless
    ``offload_buffers``): warn when those cannot fit next to what is placed there."""
    main = planner.main
    if main not in planner.budgets:
        return
    here = sum(planner.size(_unit(planner.model, n)) for n, d in plan.items() if d == main)
    buffers = 0
    for name in planner.offloaded(plan):
        unit = _unit(planner.model, name)[1]
        if isinstance(unit, nn.Module):
            buffers += sum(planner.size_of.get(id(b), 0) for b in unit.buffers())
    if here + buffers > planner.budgets[main]:
        warnings.warn(
            f"the buffers of the offloaded modules ({describe_bytes(buffers)}) stay on "
            f"{main!r} when they run, and do not fit in {describe_budget(main, planner.budgets[main])} "
            f"next to the {describe_bytes(here)} placed there; pass offload_buffers=True (they "
            f"are then loaded with their module) or raise max_memory[{main!r}]",
            stacklevel=3,
        )


def _check_room_for_blocks(planner: _Planner, plan: dict[str, Device]) -> None:
    main = planner.main
    if main not in planner.budgets:
        return  # no budget given for the execution device: nothing to check against
    blocks = [planner.largest_block(_unit(planner.model, name)) for name in planner.offloaded(plan)]
    size, name = max(blocks, default=(0, ""))
    budget = planner.budgets[main]
    if size > budget:
        module = _unit(planner.model, name)[1]
        kind = type(module).__name__ if isinstance(module, nn.Module) else "tensor"
        reason = (
            f"{kind} is in no_split_module_classes"
            if kind in planner.no_split
            else "it is a single layer or tensor"
        )
        raise DeviceMapError(
            f"{describe_budget(main, budget)} cannot hold {name!r} ({kind}, "
            f"{describe_bytes(size)}), which is offloaded and must be loaded whole on "
            f"{main!r} to run ({reason}); raise max_memory[{main!r}] to at least "
            f"{describe_bytes(size)}"
        )


def _unit(model: nn.Module, name: str) -> Unit:
    if not name:
        return "", model
    tensors = all_tensor_names(model)
    if name in tensors:
        return name, tensors[name]
    return name, model.get_submodule(name)


def clean_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> dict[str, Device]:
    """Merge entries: a module whose parts all go to one device becomes one entry."""
    plan = dict(device_map)
    for name, _ in reversed(list(model.named_modules())):
        prefix = f"{name}." if name else ""
        keys = [k for k in plan if k == name or k.startswith(prefix)]
        values = {plan[k] for k in keys}
        if len(keys) > 1 and len(values) == 1:
            first = next(i for i, k in enumerate(plan) if k in keys)
            items = [(k, v) for k, v in plan.items() if k not in keys]
            items.insert(first, (name, values.pop()))
            plan = dict(items)
    return plan


def check_device_map(
    model: nn.Module, device_map: Mapping[str, DeviceLike], must_exist: bool = False
) -> dict[str, Device]:
    """``device_map`` with its devices normalised, after checking that every device is one
    (and, with ``must_exist``, that this machine has it: dispatching and loading ask) and
    every weight is covered. Keys that name no module or tensor of ``model`` are left out
    with a warning (as Accelerate does), naming close matches.

    Example::

        check_device_map(model, {"embed": 0, "layers": "cpu", "head": "disk"})
    """
    if not isinstance(device_map, Mapping):
        raise DeviceMapError(
            f"device_map must be a dict of module name -> device, or one of {list(STRATEGIES)}; "
            f"got {device_map!r}"
        )
    modules = {name for name, _ in model.named_modules()}
    tensors = all_tensor_names(model)
    checked: dict[str, Device] = {}
    unknown: list[str] = []
    for key, device in device_map.items():
        if not isinstance(key, str) or (key not in modules and key not in tensors):
            close = difflib.get_close_matches(str(key), [*modules, *tensors], n=3)
            unknown.append(f"{key!r}" + (f" (did you mean {close}?)" if close else ""))
            continue
        checked[key] = normalize_device(device, f"device_map[{key!r}]", must_exist)
    if unknown:
        warnings.warn(
            f"device_map keys do not match any submodules or tensors of "
            f"{type(model).__name__}, and are ignored: {', '.join(unknown)}",
            stacklevel=2,
        )
    assignment = assign_tensors(model, checked)
    persistent = model.state_dict(keep_vars=True)
    uncovered = [name for name in persistent if name not in assignment]
    if uncovered:
        parts = _uncovered_parts(uncovered, set(assignment))
        shown = ", ".join(repr(p) for p in parts[:6]) + (" ..." if len(parts) > 6 else "")
        raise DeviceMapError(
            f"device_map gives no device for {shown}; add {'it' if len(parts) == 1 else 'them'} "
            "(or '' as the device for everything not listed)"
        )
    return checked


def _uncovered_parts(uncovered: list[str], covered: set[str]) -> list[str]:
    """The largest modules (or tensors) none of whose tensors is covered."""
    parts: list[str] = []
    for name in uncovered:
        pieces = name.split(".")
        for depth in range(1, len(pieces) + 1):
            prefix = ".".join(pieces[:depth])
            if not any(c == prefix or c.startswith(prefix + ".") for c in covered):
                if prefix not in parts:
                    parts.append(prefix)
                break
    return parts


def assign_tensors(model: nn.Module, device_map: Mapping[str, Device]) -> dict[str, str]:
    """For every tensor name of ``model`` covered by ``device_map``: the most specific key
    covering it."""
    assignment: dict[str, str] = {}
    for name in all_tensor_names(model):
        candidate = name
        while True:
            if candidate in device_map:
                assignment[name] = candidate
                break
            if not candidate:
                break
            candidate = candidate.rpartition(".")[0]
    return assignment


def resolve_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, DeviceLike],
    max_memory: Mapping[DeviceLike, int | str] | None,
    no_split_module_classes: str | list[str] | None,
    dtype: str | torch.dtype | None,
) -> dict[str, Device]:
    """A checked device map from a strategy name (``"auto"``, ``"balanced"``,
    ``"balanced_low_0"``, ``"sequential"``) or an explicit map."""
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise DeviceMapError(
                f"device_map={device_map!r} is not a strategy; use one of {list(STRATEGIES)} "
                "or a dict of module name -> device"
            )
        budgets: Mapping[DeviceLike, int | str] | None = max_memory
        if device_map != "sequential":
            classes = sorted(no_split_classes(model, no_split_module_classes))
            balanced = get_balanced_memory(
                model, max_memory, classes, dtype, low_zero=device_map == "balanced_low_0"
            )
            budgets = {device: size for device, size in balanced.items()}
        planned = infer_auto_device_map(model, budgets, no_split_module_classes, dtype)
        return check_device_map(model, planned, must_exist=True)
    return check_device_map(model, device_map, must_exist=True)
