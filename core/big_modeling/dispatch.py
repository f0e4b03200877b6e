"""Run a model spread over devices: GPUs, the CPU, the disk.

:func:`dispatch_model` places each part of a model as its device map says and adds hooks
so the forward runs anyway: blocks on a GPU run there (inputs follow them), blocks offloaded
to the CPU or the disk are loaded onto the execution device just before their forward and
released just after. :func:`load_checkpoint_and_dispatch` plans, loads and dispatches in
one call; :func:`cpu_offload`, :func:`disk_offload` and :func:`cpu_offload_with_hook`
offload a whole model layer by layer.

Example::

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model = load_checkpoint_and_dispatch(model, "llama/", device_map="auto",
                                         max_memory={0: "20GiB", "cpu": "60GiB"},
                                         offload_folder="offload/")
    logits = model(input_ids).logits   # on the device of input_ids
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint.commit import CheckpointError
from .budgets import Device, DeviceLike, DeviceMapError, normalize_device, torch_device
from .device_map import (
    assign_tensors,
    check_device_map,
    is_offloaded,
    resolve_device_map,
)
from .device_map import (
    main_device as first_execution_device,
)
from .hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
)
from .loading import load_checkpoint_in_model
from .offload import OffloadedWeightsLoader, OffloadEntry, PrefixedDataset, offload_state_dict
from .tensors import all_tensor_names, non_persistent_buffers, set_module_tensor_to_device


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, DeviceLike],
    main_device: DeviceLike | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, OffloadEntry] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model`` as ``device_map`` says and hook it so its forward runs.

    Weights on ``"disk"`` come from ``offload_dir`` (its index, written by
    :func:`load_checkpoint_in_model`, or written now from the model's own weights); with GPUs,
    weights on ``"cpu"`` stay in RAM (``state_dict``, or the model's CPU tensors). Outputs
    come back on the device of the inputs. A model on one device needs no hooks: it is
    simply moved there (unless ``force_hooks``). ``model.hf_device_map`` records the map.

    Example::

        dispatch_model(model, {"embed": 0, "blocks": "cpu", "head": "disk"},
                       offload_dir="offload/")
    """
    _refuse_hooked(model)
    checked = check_device_map(model, device_map, must_exist=True)
    devices = list(dict.fromkeys(checked.values()))
    main = (
        normalize_device(main_device, "main_device")
        if main_device is not None
        else first_execution_device(devices)
    )
    keys = _skip_keys(model, skip_keys)
    if len(devices) == 1 and devices[0] != "disk" and not force_hooks:
        _refuse_meta(model, {name: devices[0] for name in all_tensor_names(model)})
        model.to(torch_device(devices[0]))
    else:
        weights = _offloaded_weights(
            model, checked, main, state_dict, offload_dir, offload_index, offload_buffers
        )
        _attach_hooks(model, checked, main, weights, offload_buffers, keys, preload_module_classes)
    model.__dict__["hf_device_map"] = dict(checked)
    return model


def _refuse_hooked(model: nn.Module) -> None:
    """Hooks on hooks would load weights twice and lose track of offloaded ones."""
    hooked = [
        name or "(the model)" for name, m in model.named_modules() if "_hf_hook" in m.__dict__
    ]
    if hooked:
        raise ValueError(
            f"{type(model).__name__} is already dispatched or offloaded (hooks on "
            f"{', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''}); call "
            "remove_hook_from_module(model, recurse=True) first"
        )


def _skip_keys(model: nn.Module, skip_keys: str | Iterable[str] | None) -> list[str]:
    """The caller's keys, or the ones a transformers model declares (its KV cache)."""
    if skip_keys is None:
        skip_keys = getattr(model, "_skip_keys_device_placement", None) or ()
    return [skip_keys] if isinstance(skip_keys, str) else list(skip_keys)


def _refuse_meta(model: nn.Module, placements: Mapping[str, Device]) -> None:
    empty = [
        name
        for name, tensor in all_tensor_names(model).items()
        if tensor.is_meta and placements.get(name) not in (None, "disk")
    ]
    if empty:
        shown = ", ".join(repr(n) for n in empty[:6]) + (" ..." if len(empty) > 6 else "")
        raise CheckpointError(
            f"{shown} {'has' if len(empty) == 1 else 'have'} no data (meta device) but the "
            "device map runs them from memory; load the weights first "
            "(load_checkpoint_in_model / load_checkpoint_and_dispatch)"
        )


def _offloaded_weights(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main: Device,
    state_dict: Mapping[str, torch.Tensor] | None,
    offload_dir: str | os.PathLike[str] | None,
    offload_index: Mapping[str, OffloadEntry] | None,
    offload_buffers: bool,
) -> OffloadedWeightsLoader:
    """Every offloaded tensor's storage: the offload folder, or memory (CPU offload)."""
    assignment = assign_tensors(model, device_map)
    tensors = all_tensor_names(model)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    transient = non_persistent_buffers(model)
    placements: dict[str, Device] = {}
    for name in tensors:
        device = device_map[assignment[name]] if name in assignment else main
        stays = name in transient or (name in buffers and not offload_buffers)
        placements[name] = main if stays and is_offloaded(device, main) else device
    disk = [n for n, d in placements.items() if d == "disk"]
    if disk and offload_dir is None and offload_index is None:
        raise DeviceMapError(
            f"device_map puts {', '.join(repr(n) for n in disk[:6])} on 'disk'; pass "
            "offload_dir= (the folder load_checkpoint_in_model offloaded them to, or one to "
            "write them into)"
        )
    _refuse_meta(model, placements)
    folder = os.fspath(offload_dir) if offload_dir is not None else None
    # Disk weights the model holds itself are the ones to use (written to the folder, over
    # any older entry); only empty (meta) ones are looked up in the folder's index.
    to_write = {n: tensors[n] for n in disk if not tensors[n].is_meta}
    weights = OffloadedWeightsLoader(
        state_dict=state_dict, save_folder=folder if disk else None, index=offload_index
    )
    if to_write and folder is None:
        raise DeviceMapError(
            f"device_map puts {', '.join(repr(n) for n in list(to_write)[:6])} on 'disk'; pass "
            "offload_dir= (a folder to write them into)"
        )
    if to_write and folder is not None:
        offload_state_dict(folder, to_write)
        weights = OffloadedWeightsLoader(
            state_dict=state_dict, save_folder=folder, index=offload_index
        )
    absent = [n for n in disk if n not in weights]
    if absent:
        raise CheckpointError(
            f"{', '.join(repr(n) for n in absent[:6])} {'is' if len(absent) == 1 else 'are'} "
            f"on 'disk' but neither the model nor the offload folder {folder} holds "
            f"{'it' if len(absent) == 1 else 'them'}; load the checkpoint with "
            "load_checkpoint_in_model(..., offload_folder=) first"
        )
    for name in disk:
        weights.check(name, tuple(tensors[name].shape))
    for name, device in placements.items():
        if device == "cpu" and is_offloaded(device, main) and name not in weights:
            weights.state_dict[name] = tensors[name].detach().to("cpu")
    return weights


def _attach_hooks(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main: Device,
    weights: OffloadedWeightsLoader,
    offload_buffers: bool,
    skip_keys: list[str],
    preload_module_classes: list[str] | None,
) -> None:
    """Hooks as Accelerate places them: offloaded tensors are loaded by the module that
    owns them (a whole module for ``preload_module_classes``), so an offloaded block costs
    one layer at a time; with several execution devices each block also moves its inputs."""
    assignment = assign_tensors(model, device_map)
    modules = dict(model.named_modules())
    running = {main if is_offloaded(d, main) else d for d in device_map.values()}
    for name in all_tensor_names(model):
        key = assignment.get(name)
        device = device_map[key] if key is not None else main  # "": uncovered transient buffers
        if not is_offloaded(device, main):
            set_module_tensor_to_device(model, name, torch_device(device))
    groups: dict[tuple[str, str], list[str]] = {}
    for name, key in assignment.items():
        groups.setdefault(
            (_hooked_module(name, key, modules, preload_module_classes), key), []
        ).append(name)
    # The root brings the inputs to the main device (modules without hooks run there) and
    # the outputs back to where the inputs were.
    root = AlignDevicesHook(torch_device(main), io_same_device=True, skip_keys=skip_keys)
    hooks: dict[str, list[ModelHook]] = {"": [root]}
    if len(running) > 1:  # blocks move their inputs to where they run
        for key, device in device_map.items():
            if key in modules and (key, key) not in groups:
                runs_on = torch_device(main if is_offloaded(device, main) else device)
                hooks.setdefault(key, []).append(AlignDevicesHook(runs_on, skip_keys=skip_keys))
    for (owner, key), names in groups.items():
        device = device_map[key]
        offload = is_offloaded(device, main)
        if not offload and len(running) == 1:
            continue
        prefix = f"{owner}." if owner else ""
        hook = AlignDevicesHook(
            torch_device(main if offload else device),
            offload=offload,
            weights_map=PrefixedDataset(weights, prefix),
            offload_buffers=offload_buffers,
            skip_keys=skip_keys,
            tensor_names=[n[len(prefix) :] for n in names],
        )
        hooks.setdefault(owner, []).append(hook)
    for owner, attached in hooks.items():
        for each in attached:
            add_hook_to_module(modules[owner], each, append=True)
    if any(is_offloaded(d, main) for d in device_map.values()):
        _guard_moves(model)


def _hooked_module(
    tensor: str, key: str, modules: Mapping[str, nn.Module], preload: list[str] | None
) -> str:
    """The module whose forward loads ``tensor``: its owner, or the outermost module of a
    ``preload_module_classes`` class between the device-map entry and the owner."""
    owner = tensor.rpartition(".")[0]
    if preload:
        start = key if key in modules else owner
        parts = owner.split(".") if owner else []
        depth = len(start.split(".")) if start else 0
        for end in range(depth, len(parts) + 1):
            candidate = ".".join(parts[:end])
            if type(modules[candidate]).__name__ in preload:
                return candidate
    return owner


def _guard_moves(model: nn.Module) -> None:
    """``model.to(device)`` / ``model.cuda()`` on an offloaded model would move meta
    tensors; refuse with what to do instead."""

    def refuse(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            target = torch._C._nn._parse_to(*args, **kwargs)[0] if method.__name__ == "to" else 0
            if target is not None:
                raise RuntimeError(
                    "this model is dispatched with offloaded parts (see model.hf_device_map) "
                    "and cannot be moved; dispatch it again with another device map, or call "
                    "remove_hook_from_module(model, recurse=True) after loading its weights"
                )
            return method(*args, **kwargs)

        return wrapper

    model.to = refuse(model.to)  # type: ignore[method-assign]
    model.cuda = refuse(model.cuda)  # type: ignore[method-assign]


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, DeviceLike] | None = None,
    max_memory: Mapping[DeviceLike, int | str] | None = None,
    no_split_module_classes: str | list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
) -> nn.Module:
    """Plan (``device_map="auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``,
    or a dict), load ``checkpoint`` tensor by tensor straight to its devices, and dispatch.

    ``max_memory`` caps each device (``{0: "10GiB", "cpu": "30GiB"}``); what fits nowhere
    goes to ``"disk"``, which needs ``offload_folder`` — safetensors checkpoints are read
    from their own files there, other formats are copied in. Without ``device_map`` the
    weights are only loaded (see :func:`load_checkpoint_in_model`, which also describes
    ``strict``).

    Example::

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model = load_checkpoint_and_dispatch(model, "llama/", device_map="auto",
                                             max_memory={"cpu": "4GiB"}, offload_folder="off/")
    """
    planned = device_map is not None and isinstance(device_map, str)
    resolved = (
        resolve_device_map(model, device_map, max_memory, no_split_module_classes, dtype)
        if device_map is not None
        else None
    )
    if resolved is not None and offload_folder is None:
        disk = [key for key, device in resolved.items() if device == "disk"]
        if disk and planned:
            raise DeviceMapError(
                f"the model does not fit max_memory={dict(max_memory or {}) or 'the free memory'}: "
                f"{', '.join(repr(k) for k in disk[:6])} would go to 'disk'; pass "
                "offload_folder= to offload them, or raise max_memory"
            )
        if disk:
            raise DeviceMapError(
                f"device_map puts {', '.join(repr(k) for k in disk[:6])} on 'disk'; pass "
                "offload_folder="
            )
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=resolved,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
    )
    if resolved is None:
        return model
    return dispatch_model(
        model,
        device_map=resolved,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep ``model``'s weights in RAM and bring each layer's to ``execution_device`` only
    for its forward (GPU memory: one layer at a time).

    Example::

        model = cpu_offload(model, execution_device=0)
    """
    _refuse_hooked(model)
    device = _execution_device(model, execution_device)
    if state_dict is None:
        state_dict = {n: t.detach().to("cpu") for n, t in model.state_dict().items()}
    weights = OffloadedWeightsLoader(state_dict=state_dict)
    return _offload_through_hooks(model, device, weights, offload_buffers, preload_module_classes)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep ``model``'s weights on disk in ``offload_dir`` and read each layer's, memory-
    mapped, only for its forward (RAM: one layer at a time).

    A model with weights writes them to ``offload_dir``; an empty one (meta device) reads
    an offload folder written before.

    Example::

        model = disk_offload(model, "offload/")
    """
    _refuse_hooked(model)
    folder = os.fspath(offload_dir)
    device = _execution_device(model, execution_device)
    tensors = dict(model.state_dict())
    if any(t.is_meta for t in tensors.values()):
        weights = OffloadedWeightsLoader(save_folder=folder)
        if not weights.index:
            raise CheckpointError(
                f"the model has no weights (meta device) and {folder} holds no offload index "
                "to read them from; load them into the model, or into the folder with "
                "load_checkpoint_in_model(..., device_map={'': 'disk'}, offload_folder=)"
            )
    else:
        offload_state_dict(folder, tensors)
        weights = OffloadedWeightsLoader(save_folder=folder)
    for name, tensor in tensors.items():
        if name in weights:
            weights.check(name, tuple(tensor.shape))
    del tensors
    return _offload_through_hooks(model, device, weights, offload_buffers, preload_module_classes)


def _offload_through_hooks(
    model: nn.Module,
    device: torch.device,
    weights: OffloadedWeightsLoader,
    offload_buffers: bool,
    preload_module_classes: list[str] | None,
) -> nn.Module:
    """Hooks that bring each layer's weights from ``weights`` to ``device`` for its forward
    only, and return the model's outputs on the inputs' device."""
    skip_keys = _skip_keys(model, None)
    add_hook_to_module(
        model, AlignDevicesHook(device, io_same_device=True, skip_keys=skip_keys), append=True
    )
    attach_align_device_hook(
        model,
        device,
        offload=True,
        weights_map=weights,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` at its forward and keep it there until
    ``hook.offload()`` — or until the forward of the model chained after it with
    ``prev_module_hook`` (pipelines of several models sharing one GPU).

    Example::

        encoder, hook_1 = cpu_offload_with_hook(encoder, 0)
        decoder, hook_2 = cpu_offload_with_hook(decoder, 0, prev_module_hook=hook_1)
        decoder(encoder(x))     # the encoder went back to the CPU before the decoder ran
        hook_2.offload()
    """
    device = None if execution_device is None else _as_torch_device(execution_device)
    hook = CpuOffload(execution_device=device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _as_torch_device(device: DeviceLike) -> torch.device:
    if isinstance(device, torch.device):
        return device
    normalised = normalize_device(device, "execution_device")
    if normalised == "disk":
        raise DeviceMapError("execution_device cannot be 'disk'; weights run on a GPU or the CPU")
    return torch_device(normalised)


def _execution_device(model: nn.Module, device: DeviceLike | None) -> torch.device:
    if device is not None:
        return _as_torch_device(device)
    first = next(model.parameters(), None)
    if first is None or first.is_meta:
        from .hooks import _default_execution_device

        return _default_execution_device()
    return first.device
