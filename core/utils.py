"""Helpers importable from ``slipstream.utils`` (where Accelerate users look for them)."""

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
    "ParallelismConfig",
    "ProjectConfiguration",
    "TensorBoardTracker",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "WandBTracker",
    "broadcast",
    "broadcast_object_list",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "notebook_launcher",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
    "write_basic_config",
]
