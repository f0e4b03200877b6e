"""Beyond data parallelism: the job's device mesh, tensor-parallel plans, context parallelism
and gradient norms over DTensors. Strategies use these; users meet them through
:class:`ParallelismConfig` and the Accelerator.

Example::

    from slipstream import Accelerator, ParallelismConfig
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
"""

from .config import (
    MESH_DIMS,
    MeshSizes,
    ParallelismConfig,
    ParallelismConfigError,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from .mesh import ParallelMesh

__all__ = [
    "MESH_DIMS",
    "MeshSizes",
    "ParallelMesh",
    "ParallelismConfig",
    "ParallelismConfigError",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]
