"""Beyond data parallelism: the job's device mesh, tensor-parallel plans, context parallelism
and gradient norms over DTensors. Strategies use these; users meet them through
:class:`ParallelismConfig` and the Accelerator.

Example::

    from slipstream import Accelerator, ParallelismConfig
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
"""

from ..runtime.lazy import lazy_exports

# Loaded on first use: `from slipstream import Accelerator` does not need them.
_EXPORTS = {
    "MESH_DIMS": "config",
    "MeshSizes": "config",
    "ParallelMesh": "mesh",
    "ParallelismConfig": "config",
    "ParallelismConfigError": "errors",
    "TorchContextParallelConfig": "config",
    "TorchTensorParallelConfig": "config",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
