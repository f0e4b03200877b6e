"""Strategies and the registry that maps names to them.

Strategies for optional engines are registered by import path, so DeepSpeed (for example)
is imported only when its strategy is used.

Example::

    register_strategy("my_ddp", "my_package.strategies:MyDDP")
    strategy = get_strategy_class("ddp")(state)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..runtime.lazy import import_export
from .base import Strategy
from .ddp import DDPStrategy
from .single import SingleDeviceStrategy

if TYPE_CHECKING:
    from .deepspeed_plugin import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from .fsdp_plugin import FullyShardedDataParallelPlugin
    from .megatron_plugin import MegatronLMPlugin

# The engines' option objects load when a script names them (benchmarks/startup.py: an
# Accelerator for DDP never reads them).
_PLUGINS = {
    "DeepSpeedPlugin": "deepspeed_plugin",
    "DummyOptim": "deepspeed_plugin",
    "DummyScheduler": "deepspeed_plugin",
    "FullyShardedDataParallelPlugin": "fsdp_plugin",
    "MegatronLMPlugin": "megatron_plugin",
}

_REGISTRY: dict[str, type[Strategy] | str] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": "slipstream.strategies.fsdp:FSDPStrategy",
    "deepspeed": "slipstream.strategies.deepspeed:DeepSpeedStrategy",
    "model_parallel": "slipstream.strategies.model_parallel:ModelParallelStrategy",
    "xla": "slipstream.strategies.xla:XlaStrategy",
}


def __getattr__(name: str) -> Any:
    return import_export(__name__, _PLUGINS, globals(), name)


def register_strategy(name: str, strategy: type[Strategy] | str) -> None:
    """Register a Strategy class, or a ``"module:Class"`` path imported on first use."""
    _REGISTRY[name] = strategy


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy_class(name: str) -> type[Strategy]:
    """The Strategy class registered under ``name``."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; available: {', '.join(available_strategies())}"
        ) from None
    if isinstance(entry, str):
        module_name, _, class_name = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), class_name)
        _REGISTRY[name] = entry
    return entry


__all__ = [
    "DDPStrategy",
    "DeepSpeedPlugin",
    "DummyOptim",
    "DummyScheduler",
    "FullyShardedDataParallelPlugin",
    "MegatronLMPlugin",
    "SingleDeviceStrategy",
    "Strategy",
    "available_strategies",
    "get_strategy_class",
    "register_strategy",
]
