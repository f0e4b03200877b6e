"""Reading a model for the estimates: ``module:callable`` factories called on the meta
device (no memory, no weights), parameter counts and the units FSDP shards.

MODEL is ``module:callable`` (imported with the current directory on sys.path) or
``path/to/file.py:callable``; the callable returns an ``nn.Module`` and is called under
``torch.device("meta")``, so even a huge model costs no memory to measure.
``slipstream estimate-memory`` and ``slipstream plan`` both read models this way.

Example::

    model = build_model("my_models:make_llama")       # on the meta device
    count_parameters(model).trainable
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError
from .parameters import TensorParallelSplit, tensor_parallel_split

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ParameterCounts:
    """What the estimate needs to know about a model (element counts)."""

    total: int
    trainable: int
    buffers: int
    largest_unit: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``module:callable`` or ``path/to/file.py:callable``."""
    target, colon, name = spec.rpartition(":")
    if not colon or not target or not name:
        raise ConfigError(f"MODEL {spec!r} must be 'module:callable' or 'path/to/file.py:callable'")
    module = _import_file(target) if target.endswith(".py") else _import_module(target)
    if not hasattr(module, name):
        # Only what the module defines itself: its imports (nn, torch, ...) are noise here.
        public = sorted(
            key
            for key, value in vars(module).items()
            if not key.startswith("_")
            and callable(value)
            and getattr(value, "__module__", 0) == module.__name__
        )
        listed = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "") or "none"
        raise ConfigError(f"{target} has no attribute {name!r}; its public callables: {listed}")
    factory = getattr(module, name)
    if not callable(factory):
        kind = type(factory).__name__
        raise ConfigError(f"{spec} is {kind!r}, not callable; name a function or class")
    return factory


def _import_module(name: str) -> Any:
    # The console script's sys.path[0] is its bin folder; users expect `python -m` behaviour.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except Exception as error:
        missing = getattr(error, "name", None)  # a ModuleNotFoundError's module
        if isinstance(error, ImportError) and missing and f"{name}.".startswith(f"{missing}."):
            raise ConfigError(
                f"cannot import module {name!r} (no module named {missing!r}); run from "
                "the folder that contains it or pass path/to/file.py:callable"
            ) from None
        raise ConfigError(f"importing module {name!r} failed: {describe_error(error)}") from None


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"cannot import {path!r}: no such file")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # like `python file.py`: sibling modules are importable
        sys.path.insert(0, folder)
    try:
        return types.SimpleNamespace(**runpy.run_path(path, run_name="_slipstream_model"))
    except Exception as error:
        raise ConfigError(f"importing {path!r} failed: {describe_error(error)}") from None


def describe_error(error: BaseException) -> str:
    lines = str(error).splitlines()  # one line: the CLI prints errors on one line
    return type(error).__name__ + (f": {lines[0]}" if lines else "")


def build_model(spec: str) -> nn.Module:
    """Call the factory named by ``spec`` on the meta device and check it made a Module."""
    # torch is imported here, not at the top: `slipstream --help` should not pay for it.
    import torch
    from torch import nn

    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # e.g. it reads tensor values, which meta tensors lack
        raise ConfigError(f"{spec}() failed on the meta device: {describe_error(error)}") from None
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        raise ConfigError(f"{spec} returned {kind!r}, not a torch.nn.Module; point MODEL at one")
    return model


def units(module: nn.Module) -> Iterator[nn.Module]:
    from torch import nn

    # Plain containers are opened so each block of a stack is its own unit: the layout that
    # fully_shard on every block gives, and what FSDP gathers at a time.
    for child in module.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            yield from units(child)
        else:
            yield child


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Total and trainable parameters, buffer elements and the largest unit of ``model``."""
    parameters = list(model.parameters())  # deduplicated, so tied weights count once
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units(model)]
    own = sum(p.numel() for p in model.parameters(recurse=False))
    total = sum(p.numel() for p in parameters)
    return ParameterCounts(
        total=total,
        trainable=sum(p.numel() for p in parameters if p.requires_grad),
        buffers=sum(b.numel() for b in model.buffers()),
        # A leaf model (no children) is one unit; the root's own parameters are another.
        largest_unit=max([own, *sizes]) if sizes else total,
    )


def split_parameters(
    model: nn.Module, tp: int, ep: int = 1, ep_plan: Sequence[str] | None = None
) -> TensorParallelSplit:
    """Which weights of ``model`` tensor parallelism splits (and, with ``ep > 1``, which are
    experts), over count_parameters' units."""
    return tensor_parallel_split(model, list(units(model)), tp, ep, ep_plan)
