"""The Accelerator's parallel-layout members (Accelerate's names): the device mesh, each
process's coordinates in it, the context-parallel region, and expert parallelism's
coordinates and routing statistics.

Example::

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    accelerator.torch_device_mesh          # DeviceMesh (dp_replicate=1, dp_shard=2, tp=2)
    accelerator.tensor_parallel_rank       # 0 or 1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.state import DistributedType, ProcessState
    from .config import ParallelismConfig
    from .experts import ExpertLoad


class ParallelMixin:
    """Mesh coordinates and context parallelism for the Accelerator."""

    # Provided by the Accelerator.
    state: ProcessState
    parallelism_config: ParallelismConfig | None
    _models: list[nn.Module]

    @property
    def distributed_type(self) -> DistributedType:
        raise NotImplementedError

    def _parallelism_config(
        self, given: ParallelismConfig | None, launch: Mapping[str, Any]
    ) -> ParallelismConfig | None:
        from ..runtime.env import accelerate_layout_requested
        from .config import ParallelismConfig  # on first use: `import slipstream` stays cheap

        if given is not None:
            if not isinstance(given, ParallelismConfig):
                raise TypeError(
                    "parallelism_config takes a slipstream.ParallelismConfig, got "
                    f"{type(given).__name__}"
                )
            return given
        block = launch.get("parallelism_config") or {}
        if block:
            return ParallelismConfig.from_config(block)
        if accelerate_layout_requested():  # started by `accelerate launch` with a layout
            return ParallelismConfig()
        # The layout belongs to the processes: a later Accelerator of the same job keeps it.
        return self.state.parallelism

    def _check_deepspeed_layout(self) -> None:
        from .errors import ParallelismConfigError

        config = self.parallelism_config
        if config is None:
            return
        sizes = config.resolve(self.state.num_processes)
        if sizes.beyond_data_parallel():
            raise ParallelismConfigError(
                f"DeepSpeed cannot be combined with a parallel layout ({sizes.describe()}): "
                "DeepSpeed ZeRO shards over all processes itself. Drop the parallelism_config "
                "(or its tp/cp/pp/ep and replicate sizes), or use FSDP2 instead of DeepSpeed"
            )
        self.parallelism_config = None  # plain data parallelism: DeepSpeed's own

    # -- the mesh -----------------------------------------------------------------------
    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The job's ``DeviceMesh`` (``None`` without a ``parallelism_config``)."""
        return self.state.device_mesh

    def _mesh_rank(self, dim: str) -> int:
        mesh = self.state.mesh
        if mesh is not None:
            return mesh.local_rank(dim)
        from ..runtime.state import DistributedType

        sharded = self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        if dim == "dp_shard" and sharded:
            return self.state.process_index
        if dim == "dp_replicate" and not sharded:
            return self.state.process_index
        return 0

    @property
    def data_parallel_rank(self) -> int:
        """This process's index among the replicas (the ``dp_replicate`` dimension; the
        process index under DDP)."""
        return self._mesh_rank("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's index along the ``dp_shard`` dimension (FSDP's shards)."""
        return self._mesh_rank("dp_shard")

    @property
    def tensor_parallel_rank(self) -> int:
        return self._mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        return self._mesh_rank("cp")

    @property
    def pipeline_parallel_rank(self) -> int:
        return self._mesh_rank("pp")

    @property
    def expert_parallel_rank(self) -> int:
        """This process's index among the processes that split the experts (0 without
        expert parallelism); it holds experts ``rank * E / ep_size`` onwards."""
        return self._mesh_rank("ep")

    @property
    def expert_parallel_size(self) -> int:
        """How many processes split the experts (1 without expert parallelism)."""
        from .mesh import ParallelMesh

        mesh = self.state.mesh
        return mesh.sizes.ep if isinstance(mesh, ParallelMesh) else 1

    def expert_load(self) -> ExpertLoad:
        """Tokens routed to each expert since the last call, summed over all processes
        (a collective: every process calls it), per experts module of the prepared models;
        ``.imbalance`` is ``max / mean`` per module, ``.metrics()`` values for ``log``.
        Called once per optimizer step it gives the tokens per expert per step. Counted by
        expert-parallel experts modules (``ep_size > 1``); empty otherwise.

        Example::

            load = accelerator.expert_load()
            accelerator.log(load.metrics(), step=step)   # expert_load/max_imbalance, ...
        """
        from .experts import expert_load
        from .mesh import ParallelMesh

        mesh = self.state.mesh
        group = mesh.token_mesh.get_group() if isinstance(mesh, ParallelMesh) else None
        return expert_load(self._models, group)

    # -- context parallelism --------------------------------------------------------------
    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Run the block context-parallel when ``cp_size > 1``; otherwise do nothing.

        ``buffers`` (inputs, labels, position ids...) are split along ``buffer_seq_dims`` in
        place, each process keeping its slice, and restored afterwards except those in
        ``no_restore_buffers``. Enter it anew for every step.
        """
        mesh = self.state.mesh
        cp_mesh = mesh.submesh("cp") if mesh is not None else None
        if cp_mesh is None:
            yield
            return
        from .context_parallel import context_parallel_region

        config = self.parallelism_config
        assert config is not None and config.cp_handler is not None
        with context_parallel_region(
            cp_mesh,
            list(buffers or []),
            list(buffer_seq_dims or []),
            no_restore_buffers,
            config.cp_handler.cp_comm_strategy,
        ):
            yield
