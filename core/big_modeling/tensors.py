"""The tensors a model holds: naming them, sizing them, finding tied ones, replacing one.

Everything here works on meta tensors too (shapes and dtypes only), so a model built under
:func:`~slipstream.big_modeling.init_empty_weights` can be measured and planned for before
a byte of it exists.

Example::

    sizes = compute_module_sizes(model, dtype=torch.bfloat16)   # bytes per module name
    set_module_tensor_to_device(model, "lm_head.weight", "cpu", value=weight)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``torch.bfloat16`` for ``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    found = _DTYPE_NAMES.get(name, getattr(torch, name, None))
    if not isinstance(found, torch.dtype):
        raise ValueError(
            f"dtype={dtype!r} is not a torch dtype; write e.g. torch.bfloat16, 'bfloat16' or 'fp16'"
        )
    return found


def parameter_like(old: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``data`` with ``old``'s class, ``requires_grad`` and attributes."""
    extra = dict(old.__dict__)
    if type(old) is nn.Parameter or not isinstance(old, nn.Parameter):
        new = nn.Parameter(data, requires_grad=bool(old.requires_grad and data.is_floating_point()))
    else:  # a subclass (quantized weights, ...) may take its state in the constructor
        new = type(old)(data, requires_grad=old.requires_grad, **extra)
    new.__dict__.update(extra)
    return new


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Full names of the buffers of ``module`` that ``state_dict`` leaves out."""
    return {
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    }


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (then buffers) of ``module``; each tied tensor under its first name."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = non_persistent_buffers(module) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skipped:
                yield name, buffer


def all_tensor_names(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name of every parameter and buffer, tied names included (``state_dict`` order
    for persistent ones, then the non-persistent buffers)."""
    found: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
    for name, tensor in module.named_buffers(remove_duplicate=False):
        found.setdefault(name, tensor)
    for name, tensor in module.named_parameters(remove_duplicate=False):
        found.setdefault(name, tensor)
    return found


def tie_groups(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """For every tensor name shared with other names (tied weights): all of its names."""
    by_object: dict[int, list[str]] = {}
    for name, tensor in all_tensor_names(module).items():
        by_object.setdefault(id(tensor), []).append(name)
    return {name: tuple(names) for names in by_object.values() if len(names) > 1 for name in names}


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. an embedding and an LM head).

    Example::

        find_tied_parameters(model)   # [['lm_head.weight', 'model.embed_tokens.weight']]
    """
    groups = {tuple(sorted(g)) for g in tie_groups(model).values()}
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return sorted([list(g) for g in groups if set(g) <= parameters])


def tensor_nbytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes ``tensor`` takes once loaded (floating-point tensors converted to ``dtype``,
    never upcast: a bf16 weight stays 2 bytes under ``dtype=float32``, as it is loaded)."""
    size = tensor.element_size()
    if dtype is not None and tensor.is_floating_point():
        size = min(size, torch.empty((), dtype=dtype).element_size())
    return tensor.numel() * size


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> dict[str, int]:
    """Bytes of every module and tensor of ``model`` (``""`` is the whole model); a tied
    tensor counts once, under its first name.

    Example::

        compute_module_sizes(model)[""]            # total bytes
        compute_module_sizes(model)["model.layers.0"]
    """
    resolved = resolve_dtype(dtype)
    special = {k: resolve_dtype(v) for k, v in (special_dtypes or {}).items()}
    sizes = {name: 0 for name, _ in model.named_modules()}
    for name, tensor in named_module_tensors(model, recurse=True):
        size = tensor_nbytes(tensor, special.get(name, resolved))
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            key = ".".join(parts[:depth])
            sizes[key] = sizes.get(key, 0) + size
    return sizes


def _owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    path, _, attribute = tensor_name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        raise KeyError(f"{type(module).__name__} has no submodule {path!r}") from None
    if attribute not in owner._parameters and attribute not in owner._buffers:
        raise KeyError(
            f"{type(module).__name__} has no parameter or buffer {tensor_name!r} "
            f"({type(owner).__name__} at {path or 'the root'} holds "
            f"{sorted([*owner._parameters, *owner._buffers]) or 'none'})"
        )
    return owner, attribute


def get_module_tensor(module: nn.Module, tensor_name: str) -> torch.Tensor:
    """The parameter or buffer ``tensor_name`` (dotted) of ``module``."""
    owner, attribute = _owner(module, tensor_name)
    found = owner._parameters.get(attribute)
    tensor = found if found is not None else owner._buffers.get(attribute)
    if tensor is None:
        raise KeyError(f"{tensor_name!r} of {type(module).__name__} is None")
    return tensor


def assign_module_tensor(module: nn.Module, tensor_name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` (already converted: a Parameter for parameters) at ``tensor_name``."""
    owner, attribute = _owner(module, tensor_name)
    if attribute in owner._parameters:
        owner._parameters[attribute] = tensor  # type: ignore[assignment]
    else:
        owner._buffers[attribute] = tensor


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
) -> None:
    """Replace the parameter or buffer ``tensor_name`` with ``value`` (or its current data)
    on ``device``; floating-point values take ``dtype``, else the tensor's current dtype.

    Moving to ``"meta"`` drops the data (how offloaded weights are released).

    Example::

        set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.zeros(4, 4))
    """
    old = get_module_tensor(module, tensor_name)
    target = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    data = old if value is None else value
    if value is not None and tuple(value.shape) != tuple(old.shape):
        # Accelerate's wording: scripts and tests compare it.
        raise ValueError(
            f'Trying to set a tensor of shape {value.shape} in "{tensor_name.split(".")[-1]}" '
            f"(which has shape {old.shape}), this looks incorrect."
        )
    if value is None and old.is_meta and target.type != "meta":
        raise ValueError(
            f"{tensor_name!r} is on the meta device (it has no data); pass value= to give it some"
        )
    wanted = resolve_dtype(dtype) or old.dtype
    cast = wanted if data.is_floating_point() and wanted.is_floating_point else data.dtype
    with torch.no_grad():
        if target.type == "meta":
            new = torch.empty(data.shape, dtype=cast, device="meta")
        else:
            new = data.to(device=target, dtype=cast)
    assign_module_tensor(
        module, tensor_name, parameter_like(old, new) if isinstance(old, nn.Parameter) else new
    )


def describe_bytes(size: float) -> str:
    """``'1.5 GiB'`` for 1610612736."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value} B"  # unreachable: the loop returns at TiB


def class_names(model: nn.Module) -> set[str]:
    """Class names of every module of ``model``."""
    return {type(m).__name__ for m in model.modules()}
