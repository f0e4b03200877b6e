"""slipstream: one plain PyTorch training script on a CPU, many processes, GPUs or machines.

Example::

    from slipstream import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from .accelerator import Accelerator, PrepareError
from .callbacks import (
    Callback,
    CallbackError,
    EarlyStopping,
    GradientNormMonitor,
    ThroughputMonitor,
)
from .collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from .compile import CompileError
from .data import skip_first_batches
from .debug import CollectiveMismatchError
from .kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .logger import get_logger
from .memory import find_executable_batch_size, release_memory
from .notebook import notebook_launcher
from .random import set_seed
from .state import DistributedType, ProcessState
from .strategies import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    FullyShardedDataParallelPlugin,
)
from .tree import send_to_device

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "Callback",
    "CallbackError",
    "CollectiveMismatchError",
    "CompileError",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "EarlyStopping",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientNormMonitor",
    "InitProcessGroupKwargs",
    "PrepareError",
    "ProcessState",
    "ProjectConfiguration",
    "ThroughputMonitor",
    "TorchDynamoPlugin",
    "__version__",
    "broadcast",
    "broadcast_object_list",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_logger",
    "notebook_launcher",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
]
