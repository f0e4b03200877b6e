"""N-D parallelism on one device mesh: tensor parallelism inside, FSDP2 (or HSDP) outside.

The order torchtitan uses: each prepared model is first split by its tensor-parallel plan
over the ``tp`` dimension (DTensor ``parallelize_module``), then sharded with FSDP2 over the
data-parallel dimensions (dp_shard x cp, with dp_replicate as HSDP's replica dimension).
Everything else — optimizer wiring, accumulation, checkpoints with
torch.distributed.checkpoint (loadable into any other layout) — is FSDP's.

Example::

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    model, optimizer = accelerator.prepare(model, optimizer)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ..parallel import ParallelismConfig, ParallelismConfigError
from ..parallel.clipping import clip_grad_norm_
from ..parallel.context_parallel import (
    check_context_parallel_model,
    check_context_parallel_supported,
)
from ..parallel.tensor_parallel import apply_tensor_parallel, check_divisible, resolve_plan
from ..state import DistributedType, ProcessState
from .base import sync_module_states
from .fsdp import FSDPStrategy
from .fsdp_plugin import FullyShardedDataParallelPlugin


class ModelParallelStrategy(FSDPStrategy):
    """Tensor, context and (sharded) data parallelism over the job's DeviceMesh.

    Options: the :class:`~slipstream.ParallelismConfig`, and a
    :class:`FullyShardedDataParallelPlugin` for the FSDP2 part (wrap policy, resharding,
    offload, activation checkpointing, state-dict type; checkpoints are sharded by default).
    """

    name: ClassVar[str] = "model_parallel"

    def __init__(
        self,
        state: ProcessState,
        parallelism: ParallelismConfig | None = None,
        plugin: FullyShardedDataParallelPlugin | None = None,
        mixed_precision: str = "no",
        convert_outputs_to_fp32: bool = True,
    ) -> None:
        self.parallelism = parallelism or state.parallelism or ParallelismConfig()
        # Everything that can be refused is refused before the mesh (a collective) exists.
        sizes = self.parallelism.resolve(state.num_processes)
        if sizes.pp > 1:
            raise ParallelismConfigError(
                f"pp_size={sizes.pp} asks for pipeline parallelism, which this version of "
                "slipstream does not provide yet; use pp_size=1 (the dimension is reserved)"
            )
        if sizes.cp > 1:
            check_context_parallel_supported(state.device)
        self._default_plugin = plugin is None
        super().__init__(
            state,
            plugin or FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"),
            mixed_precision,
            convert_outputs_to_fp32,
        )
        self.mesh = state.configure_parallelism(self.parallelism)
        # With one data-parallel process per TP group there is nothing to shard: FSDP would
        # only add copies and hooks (about a fifth of a step), so the model stays TP-only and
        # mixed precision runs under autocast instead of FSDP's policy.
        self.shards = sizes.dp_replicate * sizes.dp_shard * sizes.cp > 1
        self.autocast_forward = not self.shards

    @property
    def distributed_type(self) -> DistributedType:
        sizes = self.mesh.sizes
        if sizes.dp_shard * sizes.cp > 1:
            return DistributedType.FSDP
        return self.state.distributed_type

    # -- wrapping -------------------------------------------------------------------------
    def _before_sharding(self, model: nn.Module) -> None:
        sizes = self.mesh.sizes
        if sizes.tp > 1:
            tp_mesh = self.mesh.submesh("tp")
            assert tp_mesh is not None
            planned = resolve_plan(model, self.parallelism.tp_plan, sizes.tp)
            check_divisible(model, planned, sizes.tp)
            apply_tensor_parallel(
                model,
                tp_mesh,
                planned,
                sequence_parallel=self.parallelism.sequence_parallel,
                sequence_dim=self.parallelism.sequence_dim,
            )
        if sizes.cp > 1:
            check_context_parallel_model(model)

    def _shard_mesh(self) -> Any:
        return self.mesh.fsdp_mesh

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        if self.shards:
            return super().wrap_model(model, device_placement=device_placement)
        if device_placement:
            model = model.to(self.state.device)
        sync_module_states(model, self.state)
        self._before_sharding(model)
        return model

    def _wrap_targets(self, model: nn.Module) -> list[nn.Module]:
        if self._default_plugin:
            # No FSDP options given: shard each block a transformers model declares
            # unsplittable (its decoder layers) as its own unit, as torchtitan does.
            names = set(getattr(model, "_no_split_modules", None) or ())
            if names:
                return [m for m in model.modules() if m is not model and type(m).__name__ in names][
                    ::-1
                ]
        return super()._wrap_targets(model)

    # -- training step --------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # Each pipeline stage's processes hold their own parameters: copies are only counted
        # among the processes of one stage.
        holders = self.state.num_processes // self.mesh.sizes.pp
        return clip_grad_norm_(parameters, max_norm, norm_type, holders=holders)
