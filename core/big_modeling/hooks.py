"""Hooks around a module's forward: bring its weights and inputs to the execution device
just before, release offloaded weights just after (also when the forward raises).

A hook replaces the module's ``forward`` with one that calls ``pre_forward``, the original
forward, then ``post_forward`` — Accelerate's design and attribute names (``_hf_hook``,
``_old_forward``), which transformers looks for on dispatched models.

Example::

    add_hook_to_module(layer, AlignDevicesHook(execution_device="cuda:0", offload=True,
                                               weights_map=weights))
    remove_hook_from_module(model, recurse=True)      # back to plain modules
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..runtime.tree import map_tensors
from .tensors import (
    assign_module_tensor,
    get_module_tensor,
    named_module_tensors,
    non_persistent_buffers,
    parameter_like,
    set_module_tensor_to_device,
)

#: Attributes dispatch_model adds to a model (removed with its hooks).
ADDED_ATTRIBUTES = ("to", "cuda")


class ModelHook:
    """Callbacks around a module's forward; subclass and override what you need.

    Example::

        class Log(ModelHook):
            def pre_forward(self, module, *args, **kwargs):
                print(type(module).__name__)
                return args, kwargs
    """

    #: Run the wrapped forward under ``torch.no_grad()``.
    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is attached."""
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called before the forward; returns the (possibly changed) arguments."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward; returns the (possibly changed) output."""
        return output

    def on_forward_error(self, module: nn.Module) -> None:
        """Called instead of :meth:`post_forward` when the forward raised."""

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is removed."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order (``post_forward`` in the same order, as Accelerate)."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def on_forward_error(self, module: nn.Module) -> None:
        for hook in self.hooks:
            hook.on_forward_error(module)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (replacing its hook, or after it with ``append=True``).

    Example::

        add_hook_to_module(model.layers[0], AlignDevicesHook(execution_device="cpu"))
    """
    # Stored in __dict__ directly: these are plain attributes, and nn.Module's typed
    # __getattr__ would hide their types.
    attributes = module.__dict__
    existing: ModelHook | None = attributes.get("_hf_hook")
    if append and existing is not None:
        remove_hook_from_module(module)
        hook = SequentialHook(existing, hook)
    if existing is not None and "_old_forward" in attributes:
        original: Callable[..., Any] = attributes["_old_forward"]
    else:
        original = module.forward
        attributes["_old_forward"] = original
    module = hook.init_hook(module)
    module.__dict__["_hf_hook"] = hook

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        hook: ModelHook = module.__dict__["_hf_hook"]
        wrapped: Callable[..., Any] = module.__dict__["_old_forward"]
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        try:
            if hook.no_grad:
                with torch.no_grad():
                    output = wrapped(*args, **kwargs)
            else:
                output = wrapped(*args, **kwargs)
        except BaseException:
            hook.on_forward_error(module)
            raise
        return hook.post_forward(module, output)

    module.__dict__["forward"] = functools.update_wrapper(
        functools.partial(forward, module), original
    )
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and of its submodules with ``recurse=True``).

    Example::

        remove_hook_from_module(model, recurse=True)
    """
    attributes = module.__dict__
    hook: ModelHook | None = attributes.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    original = attributes.pop("_old_forward", None)
    if original is not None:
        if getattr(original, "__func__", None) is type(module).forward:
            attributes.pop("forward", None)  # the class's own forward shows through again
        else:
            attributes["forward"] = original  # a forward set on the instance before the hook
    for attribute in ADDED_ATTRIBUTES:
        module.__dict__.pop(attribute, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def has_offloaded_params(module: nn.Module) -> bool:
    """True if a hook loads ``module``'s weights only for its forward (CPU or disk offload).

    Example::

        [name for name, m in model.named_modules() if has_offloaded_params(m)]
    """
    hook = module.__dict__.get("_hf_hook")
    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
    return any(isinstance(h, AlignDevicesHook) and h.offload for h in hooks)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in ``data`` (nested containers), if any."""
    found: list[torch.device] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(tensor.device)
        return tensor

    map_tensors(note, data)
    return found[0] if found else None


def send_to_device(
    data: Any, device: torch.device | str | None, skip_keys: Iterable[str] = ()
) -> Any:
    """``data`` with its tensors on ``device``; top-level keys in ``skip_keys`` (caches,
    say) are left alone, as are objects that are not tensors."""
    if device is None:
        return data
    target = torch.device(device)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == target else tensor.to(target)

    if isinstance(data, Mapping) and skip_keys:
        skipped = set(skip_keys)
        return type(data)(  # type: ignore[call-arg]
            {k: v if k in skipped else map_tensors(move, v) for k, v in data.items()}
        )
    return map_tensors(move, data)


class AlignDevicesHook(ModelHook):
    """Runs a module on ``execution_device``: moves its inputs there and, with
    ``offload=True``, loads its weights from ``weights_map`` just before the forward and
    releases them (back to the meta device) just after.

    ``tensor_names`` limits the hook to some of the module's tensors (dispatch uses it when
    a more specific device-map entry owns the others); otherwise it covers the module's own
    tensors, and its submodules' too with ``place_submodules=True``. Buffers stay on the
    execution device unless ``offload_buffers=True``; non-persistent buffers always do.
    ``io_same_device`` moves the outputs back to the device the inputs came from.

    Example::

        add_hook_to_module(block, AlignDevicesHook("cuda:0", offload=True, weights_map=w,
                                                   place_submodules=True))
    """

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | Iterable[str] | None = None,
        tensor_names: Iterable[str] | None = None,
    ) -> None:
        self.execution_device = (
            None
            if execution_device is None
            else torch.device("cuda", execution_device)
            if isinstance(execution_device, int)
            else torch.device(execution_device)
        )
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or ())
        self.tensor_names = list(tensor_names) if tensor_names is not None else None
        self.input_device: torch.device | None = None
        #: Offloaded tensors, grouped: the names of one group share one loaded tensor.
        self.groups: list[list[str]] = []
        self.original_devices: dict[str, torch.device] = {}

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules})"
        )

    def _covered(self, module: nn.Module) -> list[str]:
        if self.tensor_names is not None:
            return list(self.tensor_names)
        recurse = self.place_submodules
        names = [n for n, _ in module.named_parameters(recurse=recurse, remove_duplicate=False)]
        names += [n for n, _ in module.named_buffers(recurse=recurse, remove_duplicate=False)]
        return names

    def init_hook(self, module: nn.Module) -> nn.Module:
        names = self._covered(module)
        if not self.offload:
            if self.execution_device is not None:
                for name in names:
                    set_module_tensor_to_device(module, name, self.execution_device)
            return module
        buffers = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        transient = non_persistent_buffers(module)
        offloaded = [
            n for n in names if n not in transient and (self.offload_buffers or n not in buffers)
        ]
        resident = [n for n in names if n not in offloaded]
        self.original_devices = {n: get_module_tensor(module, n).device for n in offloaded}
        if self.weights_map is None:
            self.weights_map = {
                n: get_module_tensor(module, n).detach().to("cpu") for n in offloaded
            }
        missing = [n for n in offloaded if n not in self.weights_map]
        if missing:
            raise KeyError(f"the weights map has no {missing[:5]} for {type(module).__name__}")
        sources: dict[Any, list[str]] = {}
        source_of = getattr(self.weights_map, "source_of", None)
        for name in offloaded:
            key = source_of(name) if source_of is not None else ("name", name)
            sources.setdefault(key, []).append(name)
        self.groups = list(sources.values())
        for name in offloaded:
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            for name in resident:
                set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device((args, kwargs))
        if self.offload and self.weights_map is not None:
            with torch.no_grad():
                for group in self.groups:
                    value = self.weights_map[group[0]]
                    if self.execution_device is not None:
                        value = value.to(self.execution_device)
                    shared: dict[bool, torch.Tensor] = {}
                    for name in group:
                        old = get_module_tensor(module, name)
                        is_parameter = isinstance(old, nn.Parameter)
                        if is_parameter not in shared:
                            shared[is_parameter] = (
                                parameter_like(old, value) if is_parameter else value
                            )
                        assign_module_tensor(module, name, shared[is_parameter])
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, self.skip_keys),
        )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self._release(module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, self.skip_keys)
        return output

    def on_forward_error(self, module: nn.Module) -> None:
        self._release(module)

    def _release(self, module: nn.Module) -> None:
        if not self.offload:
            return
        release = getattr(self.weights_map, "release", None)
        for group in self.groups:
            for name in group:
                set_module_tensor_to_device(module, name, "meta")
            if release is not None:
                release(group[0])

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    value = self.weights_map[name]
                    set_module_tensor_to_device(module, name, device, value=value)
        return module


def attach_align_device_hook(
    module: nn.Module,
    execution_device: torch.device | str | int | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: list[str] | None = None,
) -> None:
    """An :class:`AlignDevicesHook` on every submodule that holds tensors of its own (and on
    the modules of ``preload_module_classes`` for all of theirs), so each loads only its
    own weights: peak memory is the largest layer."""
    from .offload import PrefixedDataset

    preload = set(preload_module_classes or ())
    whole = type(module).__name__ in preload
    has_own = next(named_module_tensors(module, include_buffers=offload_buffers), None)
    if whole or has_own is not None:
        prefix = f"{module_name}." if module_name else ""
        view = PrefixedDataset(weights_map, prefix) if weights_map is not None else None
        hook = AlignDevicesHook(
            execution_device,
            offload=offload,
            weights_map=view,
            offload_buffers=offload_buffers,
            place_submodules=whole,
            skip_keys=skip_keys,
        )
        add_hook_to_module(module, hook, append=True)
    if whole:
        return
    for name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{name}" if module_name else name,
            skip_keys,
            preload_module_classes,
        )


class CpuOffload(ModelHook):
    """Moves the whole module to ``execution_device`` at its first forward and keeps it
    there until :meth:`UserCpuOffloadHook.offload` (or the next model's forward, with
    ``prev_module_hook``) sends it back to the CPU."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ) -> None:
        from .budgets import torch_device

        if execution_device is None:
            execution_device = _default_execution_device()
        self.execution_device = (
            torch_device(execution_device)
            if isinstance(execution_device, int)
            else torch.device(execution_device)
        )
        self.prev_module_hook = prev_module_hook

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        previous = self.prev_module_hook
        if previous is not None and _device_of(previous.model) != torch.device("cpu"):
            previous.offload()
        if _device_of(module) != self.execution_device:
            module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device
        )


class UserCpuOffloadHook:
    """What :func:`cpu_offload_with_hook` returns: ``offload()`` sends the model back to the
    CPU, ``remove()`` detaches the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _default_execution_device() -> torch.device:
    """This process's device: the current state's, else the first GPU, else the CPU."""
    from ..runtime.state import current_state, has_current_state, select_device

    if has_current_state():
        return current_state().device
    return select_device(0, 1, cpu=False)
