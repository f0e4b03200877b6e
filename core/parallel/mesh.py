"""ParallelMesh: the job's one DeviceMesh and the coordinates each part of slipstream needs.

Dimensions follow torchtitan's order (pp, dp_replicate, dp_shard, cp, tp). The two
data-parallel dimensions are always present (size 1 when unused) because FSDP2 needs them
as its 1-D (FSDP) or 2-D (HSDP) mesh; pp, cp and tp appear only when larger than one.
Derived views:

* ``dp`` — dp_replicate x dp_shard: processes that see different samples (data loading,
  ``gather_for_metrics``, ``reduce``);
* ``fsdp`` — what FSDP2 shards over: dp_shard x cp (context-parallel ranks hold the same
  weights), as a 2-D mesh with dp_replicate for HSDP;
* ``ep`` — with expert parallelism, dp_shard x cp split in two (torchtitan's layout):
  ``ep`` consecutive shards spread the experts between them, and FSDP2 shards each expert
  over the rest (``efsdp`` = dp_shard x cp / ep, with dp_replicate for HSDP).

Example::

    mesh = ParallelMesh(ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(4), "cpu")
    mesh.local_rank("tp"), mesh.data_parallel_rank, mesh.data_parallel_size
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .config import MESH_DIMS, MeshSizes, ParallelismConfig, ParallelismConfigError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.state import ProcessState

_ALWAYS_PRESENT = ("dp_replicate", "dp_shard")


class _SequentialCollectiveNotice(logging.Filter):
    # DTensor notes at warning level that gathering a tensor sharded over two mesh
    # dimensions takes two collectives. That is expected for FSDP over TP, on every
    # checkpoint, and says nothing the user can act on.
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in record.getMessage()


def quiet_dtensor_notices() -> None:
    """Drop DTensor's 'N sequential collectives' notices (idempotent)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _SequentialCollectiveNotice) for f in logger.filters):
        logger.addFilter(_SequentialCollectiveNotice())


class ParallelMesh:
    """The device mesh of one job, built once (a collective: every process builds it)."""

    def __init__(self, sizes: MeshSizes, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.sizes = sizes
        self.dim_names = tuple(d for d in MESH_DIMS if d in _ALWAYS_PRESENT or sizes.size(d) > 1)
        shape = tuple(sizes.size(d) for d in self.dim_names)
        self.mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=self.dim_names)
        self._data_parallel = self._flattened(("dp_replicate", "dp_shard"), "dp")
        shard_dims = ("dp_shard", "cp") if sizes.cp > 1 else ("dp_shard",)
        self._shard = self._flattened(shard_dims, "dp_shard_cp")
        # The processes of one pipeline stage: every dimension but pp.
        stage_dims = tuple(d for d in self.dim_names if d != "pp")
        self._stage = self._flattened(stage_dims, "stage") if sizes.pp > 1 else None
        self._experts = self._expert_meshes() if sizes.ep > 1 else None
        self._tokens = self._data_parallel
        if sizes.cp > 1:  # context-parallel processes hold other tokens of the same samples
            self._tokens = self._shard
            if sizes.dp_replicate > 1:
                self._tokens = self._flattened(("dp_replicate", "dp_shard", "cp"), "dp_cp")
        quiet_dtensor_notices()

    def _flattened(self, dims: tuple[str, ...], name: str) -> DeviceMesh:
        if len(dims) == 1:
            return self.mesh[dims[0]]
        return self.mesh[dims]._flatten(name)

    def _expert_meshes(self) -> DeviceMesh:
        # Unflattening the shard dimension keeps one root mesh, which FSDP2 needs to put its
        # sharding of an expert next to the expert split (one DTensor over both).
        shard_name = "dp_shard_cp" if self.sizes.cp > 1 else "dp_shard"
        shards = self.sizes.dp_shard * self.sizes.cp
        both = self.mesh["dp_replicate", shard_name]
        ep = self.sizes.ep
        return both._unflatten(shard_name, (shards // ep, ep), ("efsdp", "ep"))

    # -- views --------------------------------------------------------------------------
    def submesh(self, dim: str) -> DeviceMesh | None:
        """The 1-D mesh of ``dim``, or ``None`` when that dimension is not used (``"ep"``:
        the processes that split the experts between them)."""
        if dim == "ep":
            return self._experts["ep"] if self._experts is not None else None
        return self.mesh[dim] if dim in self.dim_names else None

    @property
    def expert_shard_mesh(self) -> DeviceMesh | None:
        """What FSDP2 shards each expert over under expert parallelism (the shards that hold
        the same experts: 1-D, or 2-D with the replicas for HSDP); ``None`` without it."""
        if self._experts is None:
            return None
        if self.sizes.dp_replicate > 1:
            return self._experts["dp_replicate", "efsdp"]
        return self._experts["efsdp"]

    @property
    def token_mesh(self) -> DeviceMesh:
        """Processes that hold different tokens of a batch: the data-parallel ones and the
        context-parallel ones (flattened). Batch statistics such as a router's load are
        summed over these."""
        return self._tokens

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """Processes that see different samples (dp_replicate x dp_shard, flattened)."""
        return self._data_parallel

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: 1-D (dp_shard x cp) or, with replicas, 2-D for HSDP."""
        if self.sizes.dp_replicate > 1:
            shard_name = "dp_shard_cp" if self.sizes.cp > 1 else "dp_shard"
            return self.mesh["dp_replicate", shard_name]
        return self._shard

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The processes holding the same pipeline stage(s) (``None`` without pp)."""
        return self._stage.get_group() if self._stage is not None else None

    # -- coordinates --------------------------------------------------------------------
    def local_rank(self, dim: str) -> int:
        """This process's index along ``dim`` (0 for unused dimensions; ``"ep"`` too)."""
        if dim == "ep":
            return self._experts.get_local_rank("ep") if self._experts is not None else 0
        return self.mesh.get_local_rank(dim) if dim in self.dim_names else 0

    @property
    def data_parallel_rank(self) -> int:
        return self._data_parallel.get_local_rank()

    @property
    def data_parallel_size(self) -> int:
        return self.sizes.data_parallel_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._data_parallel.get_group()

    def __repr__(self) -> str:
        return f"ParallelMesh({self.sizes.describe()}, dims={self.dim_names})"


def configure_parallelism(state: ProcessState, config: ParallelismConfig) -> ParallelMesh:
    """Arrange the processes of ``state`` as ``config`` says and build the job's DeviceMesh
    (once; it is kept on the state, where loaders and collectives find it).

    A collective: every process must call it. Asking again for the same sizes returns the
    existing mesh; asking for different ones is an error.
    """
    sizes = config.resolve(state.num_processes)
    mesh = state.mesh
    if mesh is not None:
        assert isinstance(mesh, ParallelMesh)
        if mesh.sizes != sizes:
            raise ParallelismConfigError(
                f"the processes are already arranged as {mesh.sizes.describe()}; a job "
                f"has one layout, so {sizes.describe()} cannot be used as well. Create one "
                "Accelerator per process, with one ParallelismConfig"
            )
    else:
        state.ensure_process_group()
        mesh = ParallelMesh(sizes, state.device.type)
    state.set_layout(config, mesh)
    return mesh
