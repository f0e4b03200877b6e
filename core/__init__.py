"""slipstream: one plain PyTorch training script on a CPU, many processes, GPUs or machines.

Example::

    from slipstream import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Public names and the module each lives in; imported on first use so that
# ``import slipstream`` costs about as much as ``import torch`` (benchmarks/startup.py).
_EXPORTS = {
    "Accelerator": "accelerator",
    "AcceleratorState": "accelerator.shared_state",
    "AutocastKwargs": "options.kwargs",
    "BadStepError": "callbacks",
    "BadStepGuard": "callbacks",
    "Callback": "callbacks",
    "CallbackError": "callbacks",
    "CollectiveMismatchError": "runtime.errors",
    "CompileError": "accelerator.compile",
    "DDPCommunicationHookType": "options.kwargs",
    "DataLoaderConfiguration": "options.kwargs",
    "DeepSpeedPlugin": "strategies",
    "DistributedDataParallelKwargs": "options.kwargs",
    "DistributedOperationException": "runtime.errors",
    "DistributedType": "runtime.state",
    "DummyOptim": "strategies",
    "DummyScheduler": "strategies",
    "EarlyStopping": "callbacks",
    "FaultToleranceKwargs": "options.fault_tolerance",
    "FullyShardedDataParallelPlugin": "strategies",
    "GradScalerKwargs": "options.kwargs",
    "GradientAccumulationPlugin": "options.kwargs",
    "GradientState": "accelerator.shared_state",
    "GradientNormMonitor": "callbacks",
    "InitProcessGroupKwargs": "options.kwargs",
    "ParallelismConfig": "parallel",
    "PartialState": "runtime.partial_state",
    "PrepareError": "accelerator.preparation",
    "ProcessState": "runtime.state",
    "ProfileKwargs": "options.kwargs",
    "ProjectConfiguration": "options.kwargs",
    "SemiSyncKwargs": "options.fault_tolerance",
    "StragglerMonitor": "callbacks",
    "ThroughputMonitor": "callbacks",
    "TorchContextParallelConfig": "parallel",
    "TorchDynamoPlugin": "accelerator.compile",
    "TorchTensorParallelConfig": "parallel",
    "broadcast": "runtime.collectives",
    "broadcast_object_list": "runtime.collectives",
    "cpu_offload": "big_modeling",
    "cpu_offload_with_hook": "big_modeling",
    "debug_launcher": "launcher.notebook",
    "disk_offload": "big_modeling",
    "dispatch_model": "big_modeling",
    "find_executable_batch_size": "utils.memory",
    "gather": "runtime.collectives",
    "gather_object": "runtime.collectives",
    "get_logger": "logging",
    "infer_auto_device_map": "big_modeling",
    "init_empty_weights": "big_modeling",
    "init_on_device": "big_modeling",
    "is_rich_available": "utils.availability",
    "load_checkpoint_and_dispatch": "big_modeling",
    "load_checkpoint_in_model": "big_modeling",
    "notebook_launcher": "launcher.notebook",
    "pad_across_processes": "runtime.collectives",
    "plan": "planning",
    "reduce": "runtime.collectives",
    "release_memory": "utils.memory",
    "send_to_device": "runtime.tree",
    "set_seed": "runtime.random",
    "skip_first_batches": "data",
    "synchronize_rng_states": "runtime.synchronize",
}

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "BadStepError",
    "BadStepGuard",
    "Callback",
    "CallbackError",
    "CollectiveMismatchError",
    "CompileError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "EarlyStopping",
    "FaultToleranceKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientNormMonitor",
    "GradientState",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "PrepareError",
    "ProcessState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "SemiSyncKwargs",
    "StragglerMonitor",
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
    "plan",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_states",
]


def __getattr__(name: str) -> Any:
    # The helper is imported here, not above: `import slipstream` alone loads no submodule.
    from .runtime.lazy import import_export

    return import_export(__name__, _EXPORTS, globals(), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
