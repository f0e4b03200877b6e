"""N-D parallelism on one device mesh: tensor parallelism inside, FSDP2 (or HSDP) outside.

The order torchtitan uses: each prepared model is first split by its tensor-parallel plan
over the ``tp`` dimension (DTensor ``parallelize_module``), then its experts (with
``ep_size > 1``) are spread over the ``ep`` processes and each experts module is sharded by
FSDP2 over the shards that hold the same experts, then the rest is sharded with FSDP2 over
the data-parallel dimensions (dp_shard x cp, with dp_replicate as HSDP's replica dimension).
Everything else — optimizer wiring, accumulation, checkpoints with
torch.distributed.checkpoint (loadable into any other layout) — is FSDP's.

Example::

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    model, optimizer = accelerator.prepare(model, optimizer)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..parallel import ParallelismConfig, ParallelismConfigError
from ..parallel.clipping import clip_grad_norm_
from ..parallel.context_parallel import (
    check_context_parallel_model,
    check_context_parallel_supported,
)
from ..parallel.experts import (
    ExpertParallel,
    expert_parallel_modules,
    inside_experts,
    install_global_aux_loss,
    resolve_experts,
)
from ..parallel.experts import weights as expert_weights
from ..parallel.mesh import configure_parallelism
from ..parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_divisible,
    check_sequence_parallel,
    resolve_plan,
)
from ..runtime.state import DistributedType, ProcessState
from .base import sync_module_states
from .fsdp import FSDPStrategy
from .fsdp_plugin import FullyShardedDataParallelPlugin

if TYPE_CHECKING:
    from ..checkpoint.io import CheckpointReader


class ModelParallelStrategy(FSDPStrategy):
    """Tensor, context, expert and (sharded) data parallelism over the job's DeviceMesh.

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
        return self.state.device_distributed_type

    # -- wrapping -------------------------------------------------------------------------
    def _tensor_parallel_plan(self, model: nn.Module, whole_model: bool) -> list[Any]:
        sizes = self.mesh.sizes
        if self.parallelism.sequence_parallel and whole_model:
            check_sequence_parallel(model)
        planned = resolve_plan(model, self.parallelism.tp_plan, sizes.tp, whole_model=whole_model)
        if sizes.ep > 1 or self.parallelism.tp_plan is None:
            # Experts are split by ep (or, without it, kept whole on every TP process): a
            # model's own plan for tensor-parallel experts does not apply.
            experts = self._experts(model, whole_model, required=sizes.ep > 1)
            planned = [entry for entry in planned if not inside_experts(entry.name, experts)]
        check_divisible(model, planned, sizes.tp)
        return planned

    def _experts(self, model: nn.Module, whole_model: bool, *, required: bool) -> list[Any]:
        """The model's experts modules; without expert parallelism, those its own (or the
        user's) plan names, if any (no error when there are none)."""
        if required:
            ep = self.mesh.sizes.ep
            return resolve_experts(model, self.parallelism.ep_plan, ep, whole_model=whole_model)
        try:
            return resolve_experts(model, self.parallelism.ep_plan, 1, whole_model=False)
        except ParallelismConfigError:
            return []

    def _expert_parallel(self, model: nn.Module) -> None:
        """Spread the experts over the ``ep`` processes; FSDP2 shards each experts module
        over the processes holding the same experts."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        sizes = self.mesh.sizes
        ep_mesh, shard_mesh = self.mesh.submesh("ep"), self.mesh.expert_shard_mesh
        assert ep_mesh is not None and shard_mesh is not None
        experts = self._experts(model, sizes.pp == 1, required=True)
        if any(e.listed is not None for e in experts) and not self.plugin.sharded_state_dict:
            raise ParallelismConfigError(
                "experts held in an nn.ModuleList are kept whole by one expert-parallel "
                "process each: use state_dict_type='SHARDED_STATE_DICT' for checkpoints "
                "(get_state_dict and save_model still give the whole model)"
            )
        kwargs = self._policy_kwargs()
        kwargs["mp_policy"] = dataclasses.replace(kwargs["mp_policy"], output_dtype=None)
        shards = shard_mesh.size(shard_mesh.ndim - 1)

        def placement(weight: torch.Tensor) -> Shard:
            # Shard whole experts when each shard gets some; otherwise split every expert.
            experts_here = weight.shape[0] // sizes.ep
            return Shard(0) if weight.ndim == 1 or experts_here % shards == 0 else Shard(1)

        import torch.distributed as dist

        backend = str(dist.get_backend(ep_mesh.get_group()))
        premultiplied_sum_missing = not any(name in backend for name in ("nccl", "xccl"))
        for entry in experts:
            ExpertParallel(entry, ep_mesh).install()
            stacked = entry.listed is None
            unit = fully_shard(
                entry.module,
                mesh=shard_mesh,
                shard_placement_fn=placement if stacked else None,
                **kwargs,
            )
            # Each process's expert gradients already sum over its expert group's tokens:
            # divide by all data-parallel processes, not only those FSDP reduces over.
            unit.set_gradient_divide_factor(float(sizes.dp_replicate * sizes.dp_shard * sizes.cp))
            if premultiplied_sum_missing and shards > 1:
                # gloo has no PREMUL_SUM: sum, then divide. (Not with one shard: torch then
                # divides by the factor both before and after its copy.)
                unit.set_force_sum_reduction_for_comms(True)

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
        if sizes.ep > 1:
            self._expert_parallel(model)
        if sizes.pp == 1 and self.mesh.token_mesh.size() > 1:
            # The router's load-balancing loss of the global batch, as one process computes it.
            install_global_aux_loss(model, self.mesh.token_mesh.get_group())
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
            if self.mesh.sizes.ep > 1:  # checked on the whole model, before it is split
                self._experts(model, whole_model=True, required=True)
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
        if self.plugin.activation_checkpointing:  # the blocks FSDP would have made units
            self._checkpoint_layers(model, self._wrap_targets(model))
        return model

    def _swap_parameters(
        self, optimizer: torch.optim.Optimizer, replacement: dict[int, torch.nn.Parameter]
    ) -> None:
        if self.mesh.sizes.pp > 1 or self.mesh.sizes.ep > 1:
            # Parameters of other processes' stages (and listed experts) are gone from here.
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
    def _listed_prefixes(self, model: nn.Module) -> list[str]:
        return expert_weights.listed_prefixes(expert_parallel_modules([model]))

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict on the main process (empty on the others); under pipeline
        parallelism each stage's part is gathered from the stage's first process, listed
        experts from their expert-parallel processes."""
        listed = self._listed_prefixes(model)
        if self.mesh.sizes.pp == 1 and not listed:
            return super().model_state_dict(model)
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        others = [d for d in self.mesh.dim_names if d != "pp"]
        if listed:
            # The expert group of the first shard (coordinate 0 in every other dimension but
            # pp) collects every process's own experts on its first process.
            mesh, sizes = self.mesh, self.mesh.sizes
            shard = mesh.local_rank("dp_shard") * sizes.cp + mesh.local_rank("cp")
            ep_mesh = mesh.submesh("ep")
            if mesh.local_rank("dp_replicate") or mesh.local_rank("tp") or shard >= sizes.ep:
                return {}
            assert ep_mesh is not None
            first = mesh.local_rank("ep") == 0
            full = expert_weights.merge_listed_experts(
                full, listed, ep_mesh.get_group(), receive=first
            )
            if sizes.pp == 1:
                return full if self.state.is_main_process else {}
        # The first process of every stage (coordinate 0 in all other dimensions) sends its
        # stage's part; these processes form the pipeline group of process 0.
        if any(self.mesh.local_rank(d) != 0 for d in others):
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

    def load_model_checkpoint(
        self, model: nn.Module, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        from ..checkpoint import sharded
        from ..checkpoint.names import model_folder

        listed = self._listed_prefixes(model)
        part = model_folder(index)
        if not listed or not sharded.has_part(reader, part):
            return super().load_model_checkpoint(model, reader, index)
        # Each process holds some of the listed experts; the part names all of them.
        storage = sharded.dcp_reader_arguments(reader, part)["storage_reader"]
        saved = {
            key[len("model.") :]: tuple(item.size)
            for key, item in storage.read_metadata().state_dict_metadata.items()
            if key.startswith("model.") and hasattr(item, "size")
        }
        expected = {sharded.clean_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
        where = reader.storage.url(reader.path(part))
        expert_weights.check_listed_shapes(expected, saved, listed, where)
        return lambda: sharded.load_model_part(model, reader, part)

    # -- training step --------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # Each pipeline stage's processes hold their own parameters: copies are only counted
        # among the processes of one stage. A listed expert is held by one ep process of
        # each expert group.
        holders = self.state.num_processes // self.mesh.sizes.pp
        listed = {
            id(p): holders // self.mesh.sizes.ep
            for ep in expert_parallel_modules(self.prepared_models)
            if ep.entry.listed is not None
            for p in ep.module.parameters()
        }
        return clip_grad_norm_(parameters, max_norm, norm_type, holders=holders, holders_of=listed)
