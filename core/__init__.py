"""slipstream: one plain PyTorch training script on a CPU, many processes, GPUs or machines.

Example::

    from slipstream import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module each lives in; imported on first use so that
# ``import slipstream`` costs about as much as ``import torch`` (benchmarks/startup.py).
_EXPORTS = {
    "Accelerator": "accelerator",
    "AutocastKwargs": "kwargs",
    "Callback": "callbacks",
    "CallbackError": "callbacks",
    "CollectiveMismatchError": "debug",
    "CompileError": "compile",
    "DDPCommunicationHookType": "kwargs",
    "DataLoaderConfiguration": "kwargs",
    "DeepSpeedPlugin": "strategies",
    "DistributedDataParallelKwargs": "kwargs",
    "DistributedType": "state",
    "DummyOptim": "strategies",
    "DummyScheduler": "strategies",
    "EarlyStopping": "callbacks",
    "FullyShardedDataParallelPlugin": "strategies",
    "GradScalerKwargs": "kwargs",
    "GradientAccumulationPlugin": "kwargs",
    "GradientNormMonitor": "callbacks",
    "InitProcessGroupKwargs": "kwargs",
    "ParallelismConfig": "parallel",
    "PartialState": "partial_state",
    "PrepareError": "preparation",
    "ProcessState": "state",
    "ProfileKwargs": "kwargs",
    "ProjectConfiguration": "kwargs",
    "ThroughputMonitor": "callbacks",
    "TorchContextParallelConfig": "parallel",
    "TorchDynamoPlugin": "kwargs",
    "TorchTensorParallelConfig": "parallel",
    "broadcast": "collectives",
    "broadcast_object_list": "collectives",
    "cpu_offload": "big_modeling",
    "cpu_offload_with_hook": "big_modeling",
    "debug_launcher": "notebook",
    "disk_offload": "big_modeling",
    "dispatch_model": "big_modeling",
    "find_executable_batch_size": "memory",
    "gather": "collectives",
    "gather_object": "collectives",
    "get_logger": "logger",
    "infer_auto_device_map": "big_modeling",
    "init_empty_weights": "big_modeling",
    "init_on_device": "big_modeling",
    "is_rich_available": "availability",
    "load_checkpoint_and_dispatch": "big_modeling",
    "load_checkpoint_in_model": "big_modeling",
    "notebook_launcher": "notebook",
    "pad_across_processes": "collectives",
    "reduce": "collectives",
    "release_memory": "memory",
    "send_to_device": "tree",
    "set_seed": "random",
    "skip_first_batches": "data",
    "synchronize_rng_states": "synchronize",
}

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "Callback",
    "CallbackError",
    "CollectiveMismatchError",
    "CompileError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "EarlyStopping",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientNormMonitor",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "PrepareError",
    "ProcessState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "ThroughputMonitor",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "__version__",
    "broadcast",
    "broadcast_object_list",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_logger",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_states",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
