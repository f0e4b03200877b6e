"""Looking inside models and objects: wrappers, compiled modules, PEFT models, DTensors.

Example::

    model = extract_model_from_parallel(ddp_model)   # the module inside DDP / DeepSpeed
    is_compiled_module(torch.compile(model))         # True
    recursive_getattr(model, "encoder.layers")       # model.encoder.layers
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

import torch
from torch import nn

from ..precision.base import restore_forward


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile`` returned for a module."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by torch.compile
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` (or itself) was compiled with ``torch.compile``."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def _wrapper_classes() -> tuple[type, ...]:
    """The containers that hold the user's module as ``.module``; only those a library
    already imported can be wrapping anything."""
    classes: list[type] = [torch.nn.DataParallel]
    for module_name, class_name in (
        ("torch.nn.parallel.distributed", "DistributedDataParallel"),
        ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
        ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    ):
        found = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(found, type):
            classes.append(found)
    return tuple(classes)


def _unwrap_children(module: nn.Module, wrappers: tuple[type, ...]) -> nn.Module:
    while isinstance(module, wrappers) or isinstance(getattr(module, "module", None), nn.Module):
        module = cast(nn.Module, module.module)
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrap_children(child, wrappers))
    return module


def extract_model_from_parallel(
    model: nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> nn.Module:
    """The user's module inside DDP, DataParallel, FSDP1 or DeepSpeed's engine.

    ``keep_fp32_wrapper=False`` also removes the mixed-precision forward patch;
    ``keep_torch_compile=False`` returns the module under ``torch.compile``'s wrapper;
    ``recursive=True`` also unwraps every submodule held as ``.module``. FSDP2 and tensor
    parallelism change modules in place: there is nothing to extract.
    """
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = cast(nn.Module, compiled._orig_mod)
    wrappers = _wrapper_classes()
    while isinstance(model, wrappers):
        model = cast(nn.Module, model.module)
    if recursive:
        model = _unwrap_children(model, wrappers)
    if not keep_fp32_wrapper:
        restore_forward(model)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (once unwrapped) is a PEFT model (``peft.PeftModel``)."""
    from .availability import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor (sharded by FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layers")``."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_pretty_name(obj: Any) -> str:
    """The qualified name of a function or class, or of an object's class."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return str(name) if name is not None else str(obj)
