"""Helpers importable from ``slipstream.utils`` (where Accelerate users look for them)."""

from .big_modeling import (
    OffloadedWeightsLoader,
    check_device_map,
    compute_module_sizes,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    find_tied_parameters,
    get_balanced_memory,
    get_max_memory,
    has_offloaded_params,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    named_module_tensors,
    offload_state_dict,
    set_module_tensor_to_device,
)
from .cli.configure import write_basic_config
from .collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from .data import skip_first_batches
from .kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .memory import find_executable_batch_size, release_memory
from .notebook import notebook_launcher
from .parallel import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig
from .partial_state import PartialState
from .random import set_seed
from .state import DistributedType
from .strategies import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    FullyShardedDataParallelPlugin,
)
from .tracking import CSVTracker, GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker
from .tree import send_to_device

__all__ = [
    "AutocastKwargs",
    "CSVTracker",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "MLflowTracker",
    "OffloadedWeightsLoader",
    "ParallelismConfig",
    "PartialState",
    "ProjectConfiguration",
    "TensorBoardTracker",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "WandBTracker",
    "broadcast",
    "broadcast_object_list",
    "check_device_map",
    "compute_module_sizes",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "find_tied_parameters",
    "gather",
    "gather_object",
    "get_balanced_memory",
    "get_max_memory",
    "has_offloaded_params",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "named_module_tensors",
    "notebook_launcher",
    "offload_state_dict",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "skip_first_batches",
    "write_basic_config",
]
