"""Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the processes; each wrapped unit
gathers its parameters for forward and backward only. Works on CPU over gloo as on GPUs.
Checkpoints are written with torch.distributed.checkpoint (one part per process, loadable
by any number of processes) or gathered to the main process, as ``state_dict_type`` says.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed.fsdp
from torch import nn

from ..checkpoint import sharded
from ..checkpoint.names import indexed_name, model_folder, optimizer_folder
from ..checkpoint.sharded import clean_name
from ..runtime.state import DistributedType, ProcessState
from .base import Strategy, check_matching_weights, share_router_statistics, sync_module_states
from .fsdp_plugin import FullyShardedDataParallelPlugin

if TYPE_CHECKING:
    from ..checkpoint.io import CheckpointReader, CheckpointWriter


class FSDPStrategy(Strategy):
    """FSDP2 over all processes. Options: a :class:`FullyShardedDataParallelPlugin`."""

    name: ClassVar[str] = "fsdp"
    #: FSDP casts parameters itself (MixedPrecisionPolicy) instead of running under autocast.
    autocast_forward: bool = False
    forward_is_collective = True

    def __init__(
        self,
        state: ProcessState,
        plugin: FullyShardedDataParallelPlugin | None = None,
        mixed_precision: str = "no",
        convert_outputs_to_fp32: bool = True,
    ) -> None:
        super().__init__(state)
        if not hasattr(torch.distributed.fsdp, "fully_shard"):
            raise RuntimeError(
                "FSDP in slipstream is FSDP2 (torch.distributed.fsdp.fully_shard), which this "
                f"torch {torch.__version__} does not have; install torch>=2.6"
            )
        self.plugin = plugin or FullyShardedDataParallelPlugin()
        self.mixed_precision = mixed_precision
        self.convert_outputs_to_fp32 = convert_outputs_to_fp32
        state.ensure_process_group()

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    # -- wrapping -------------------------------------------------------------------------
    def _policy_kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = self.plugin.mixed_precision_policy
        if policy is None:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
            output = torch.float32 if dtype is not None and self.convert_outputs_to_fp32 else None
            policy = MixedPrecisionPolicy(
                param_dtype=dtype,
                reduce_dtype=torch.float32 if dtype else None,
                output_dtype=output,
            )
        elif isinstance(policy, dict):
            policy = MixedPrecisionPolicy(**policy)
        offload: Any = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if self.plugin.cpu_offload
            else OffloadPolicy()
        )
        return {
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "mp_policy": policy,
            "offload_policy": offload,
        }

    def _wrap_targets(self, model: nn.Module) -> list[nn.Module]:
        """Submodules sharded as their own units (children before parents)."""
        plugin = self.plugin
        if plugin.auto_wrap_policy == "transformer_based_wrap":
            names = plugin.wrap_classes(model)
            present = {type(m).__name__ for m in model.modules()}
            missing = [n for n in names if n not in present]
            if missing:
                raise ValueError(
                    f"transformer_cls_names_to_wrap names {missing} that match no module of "
                    f"{type(model).__name__}; its module classes are: {', '.join(sorted(present))}"
                )
            wanted = set(names)
            return [m for m in model.modules() if m is not model and type(m).__name__ in wanted][
                ::-1
            ]
        if plugin.auto_wrap_policy == "size_based_wrap":
            chosen: list[nn.Module] = []

            def visit(module: nn.Module) -> int:
                # Parameters of this module not already inside a chosen descendant.
                size = sum(p.numel() for p in module.parameters(recurse=False))
                size += sum(visit(child) for child in module.children())
                if module is not model and size >= plugin.min_num_params:
                    chosen.append(module)
                    return 0
                return size

            visit(model)
            return chosen
        return []

    def _checkpoint_layers(self, model: nn.Module, targets: list[nn.Module]) -> list[nn.Module]:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        if not targets:
            raise ValueError(
                "activation_checkpointing recomputes the wrapped layers, but the wrap policy "
                "selects none; set transformer_cls_names_to_wrap or min_num_params"
            )
        wrapped: dict[int, nn.Module] = {}
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if any(child is t for t in targets):
                    wrapper = checkpoint_wrapper(child)
                    setattr(parent, child_name, wrapper)
                    wrapped[id(child)] = wrapper
        return [wrapped[id(t)] for t in targets]

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):
            raise ValueError(
                "prepare() got a model already sharded with fully_shard; pass the plain module"
            )
        if not any(True for _ in model.parameters()):
            raise ValueError(
                f"FSDP shards parameters, but {type(model).__name__} has none; prepare it "
                "without FSDP or give it parameters"
            )
        if device_placement and not self.plugin.cpu_offload:
            model = model.to(self.state.device)
        sync_module_states(model, self.state, self._sync_group())
        self._before_sharding(model)
        targets = self._wrap_targets(model)
        if self.plugin.activation_checkpointing:
            targets = self._checkpoint_layers(model, targets)
        kwargs = self._policy_kwargs()
        mesh = self._shard_mesh()
        if mesh is not None:
            kwargs["mesh"] = mesh
        inner = dict(kwargs)
        policy = kwargs["mp_policy"]
        if policy.output_dtype is not None:
            # Only the root casts outputs back; inner units hand on their compute dtype.
            inner["mp_policy"] = dataclasses.replace(policy, output_dtype=None)
        for target in targets:
            fully_shard(target, **inner)
        fully_shard(model, **kwargs)
        return model

    def _before_sharding(self, model: nn.Module) -> None:
        """Called with the placed model before FSDP shards it (tensor parallelism)."""
        share_router_statistics(model, self.state)

    def _shard_mesh(self) -> Any:
        """The DeviceMesh FSDP shards over (``None``: all processes)."""
        return None

    def _sync_group(self) -> Any:
        """The processes that must start from the same weights (``None``: all)."""
        return None

    def setup(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        *,
        device_placement: list[bool],
        **context: Any,
    ) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        before = [{id(p): n for n, p in m.named_parameters()} for m in models]
        wrapped, _ = super().setup(models, [], device_placement=device_placement)
        replacement: dict[int, torch.nn.Parameter] = {}
        for names, model in zip(before, wrapped, strict=True):
            after = {clean_name(n): p for n, p in model.named_parameters()}
            # (A pipeline stage keeps only some parameters: the others have no replacement.)
            replacement.update(
                {pid: after[key] for pid, n in names.items() if (key := clean_name(n)) in after}
            )
        for optimizer in optimizers:
            self._swap_parameters(optimizer, replacement)
        return wrapped, optimizers

    def _swap_parameters(
        self, optimizer: torch.optim.Optimizer, replacement: dict[int, torch.nn.Parameter]
    ) -> None:
        """Point an optimizer built before sharding at the sharded parameters."""
        if optimizer.state:
            raise ValueError(
                "this optimizer already has state (it has stepped); with FSDP prepare the "
                "optimizer before its first step"
            )
        for group in optimizer.param_groups:
            group["params"] = [replacement.get(id(p), p) for p in group["params"]]
        self.owner_of(optimizer)  # raises when no prepared model owns its parameters

    # -- training step --------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            yield
            return
        # Accumulate unsharded gradients locally and keep parameters gathered between
        # micro-steps (no reduce-scatter, no re-gather until the synchronising step).
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm

    # -- weights --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict, gathered to the main process (empty on the others)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def checkpoint_state_dict(self, model: nn.Module) -> dict[str, Any]:
        if self.plugin.sharded_state_dict:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(model)
        return self.model_state_dict(model)

    def save_model_checkpoint(
        self, model: nn.Module, state_dict: dict[str, Any], writer: CheckpointWriter, index: int
    ) -> None:
        if not self.plugin.sharded_state_dict:
            super().save_model_checkpoint(model, state_dict, writer, index)
            return
        import torch.distributed.checkpoint as dcp

        name = model_folder(index)
        dcp.save({"model": state_dict}, **sharded.dcp_writer_arguments(writer, name))
        writer.written.append(name)

    def load_model_checkpoint(
        self, model: nn.Module, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        part = model_folder(index)
        if sharded.has_part(reader, part):
            sharded.check_shapes(model, reader, part)
            return lambda: sharded.load_model_part(model, reader, part)
        name = indexed_name("model", index, ".safetensors")
        full = reader.load_tensors(name, f"weights of model {index}")
        check_matching_weights(model, full, reader.storage.url(reader.path(name)))
        options = StateDictOptions(full_state_dict=True)

        def apply_full() -> None:
            set_model_state_dict(model, dict(full), options=options)

        return apply_full

    def save_optimizer_checkpoint(
        self, optimizer: torch.optim.Optimizer, writer: CheckpointWriter, index: int
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        model = self.owner_of(optimizer)
        if self.plugin.sharded_state_dict:
            import torch.distributed.checkpoint as dcp

            name = optimizer_folder(index)
            state = sharded.optimizer_part(model, optimizer)
            dcp.save({"optimizer": state}, **sharded.dcp_writer_arguments(writer, name))
            writer.written.append(name)
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        if self.state.is_main_process:
            writer.save_object(indexed_name("optimizer", index, ".bin"), state)

    def load_optimizer_checkpoint(
        self, optimizer: torch.optim.Optimizer, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        model = self.owner_of(optimizer)
        part = optimizer_folder(index)
        if sharded.has_part(reader, part):
            return lambda: sharded.load_optimizer_part(model, optimizer, reader, part)
        full = reader.load_object(indexed_name("optimizer", index, ".bin"), "optimizer state")
        options = StateDictOptions(full_state_dict=True)
        return lambda: set_optimizer_state_dict(model, optimizer, full, options=options)
