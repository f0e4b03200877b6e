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
from ..parallel.mesh import configure_parallelism
from ..parallel.tensor_parallel import apply_tensor_parallel, check_divisible, resolve_plan
from ..runtime.state import DistributedType, ProcessState
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
            from ..parallel.pipeline import resolve_plan as resolve_pipeline

            config = self.parallelism
            resolve_pipeline(
                sizes.pp, config.pp_schedule, config.pp_microbatches, config.pp_stages_per_rank
            )
            if plugin is not None and not plugin.sharded_state_dict:
                raise ParallelismConfigError(
                    "under pipeline parallelism each stage saves its own part: use "
                    "state_dict_type='SHARDED_STATE_DICT' (get_state_dict and save_model still "
                    "give the whole model)"
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
        self.mesh = configure_parallelism(state, self.parallelism)
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
    def _tensor_parallel_plan(self, model: nn.Module, whole_model: bool) -> list[Any]:
        sizes = self.mesh.sizes
        planned = resolve_plan(model, self.parallelism.tp_plan, sizes.tp, whole_model=whole_model)
        check_divisible(model, planned, sizes.tp)
        return planned

    def _before_sharding(self, model: nn.Module) -> None:
        sizes = self.mesh.sizes
        if sizes.tp > 1:
            tp_mesh = self.mesh.submesh("tp")
            assert tp_mesh is not None
            # A pipeline stage holds only some of the modules the plan names (the plan was
            # checked against the whole model before it was split).
            planned = self._tensor_parallel_plan(model, whole_model=sizes.pp == 1)
            apply_tensor_parallel(
                model,
                tp_mesh,
                planned,
                sequence_parallel=self.parallelism.sequence_parallel,
                sequence_dim=self.parallelism.sequence_dim,
            )
        if sizes.cp > 1:
            check_context_parallel_model(model)

    def _sync_group(self) -> Any:
        return self.mesh.stage_group

    def _shard_mesh(self) -> Any:
        return self.mesh.fsdp_mesh

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        if self.mesh.sizes.pp > 1:
            from ..parallel.pipeline import build_pipeline

            if self.mesh.sizes.tp > 1:
                self._tensor_parallel_plan(model, whole_model=True)
            return build_pipeline(
                model,
                mesh=self.mesh,
                config=self.parallelism,
                device=self.state.device,
                parallelize=lambda stage: self._parallelize(stage, device_placement),
            )
        return self._parallelize(model, device_placement)

    def _parallelize(self, model: nn.Module, device_placement: bool) -> nn.Module:
        """Tensor parallelism, then FSDP2 over the data-parallel processes (if several)."""
        if self.shards:
            return super().wrap_model(model, device_placement=device_placement)
        if device_placement:
            model = model.to(self.state.device)
        sync_module_states(model, self.state, self._sync_group())
        self._before_sharding(model)
        return model

    def _swap_parameters(
        self, optimizer: torch.optim.Optimizer, replacement: dict[int, torch.nn.Parameter]
    ) -> None:
        if self.mesh.sizes.pp > 1:
            # Parameters of other processes' stages are gone from this process.
            local = {id(p) for model in self.prepared_models for p in model.parameters()}
            local |= set(replacement)
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in local]
        super()._swap_parameters(optimizer, replacement)

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

    # -- weights --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict on the main process (empty on the others); under pipeline
        parallelism each stage's part is gathered from the stage's first process."""
        if self.mesh.sizes.pp == 1:
            return super().model_state_dict(model)
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        # The first process of every stage (coordinate 0 in all other dimensions) sends its
        # stage's part; these processes form the pipeline group of process 0.
        if any(self.mesh.local_rank(d) != 0 for d in self.mesh.dim_names if d != "pp"):
            return {}
        part = {n: t.detach().cpu() for n, t in full.items() if isinstance(t, torch.Tensor)}
        pp_mesh = self.mesh.submesh("pp")
        assert pp_mesh is not None
        parts: list[Any] = [None] * self.mesh.sizes.pp
        main = self.state.is_main_process
        dist.gather_object(part, parts if main else None, group_dst=0, group=pp_mesh.get_group())
        if not main:
            return {}
        merged: dict[str, Any] = {}
        for stage_part in parts:
            merged.update(stage_part)
        return merged

    # -- training step --------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # Each pipeline stage's processes hold their own parameters: copies are only counted
        # among the processes of one stage.
        holders = self.state.num_processes // self.mesh.sizes.pp
        return clip_grad_norm_(parameters, max_norm, norm_type, holders=holders)
