"""What the Accelerator was configured to do, as read-only facts (Accelerate's names).

Example::

    if accelerator.is_fsdp2:
        print("parameters are DTensors sharded over", accelerator.num_processes, "processes")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..runtime.state import DistributedType
from .shared_state import GradientState

if TYPE_CHECKING:
    from ..options.kwargs import DataLoaderConfiguration
    from ..runtime.state import ProcessState
    from ..strategies import DeepSpeedPlugin, FullyShardedDataParallelPlugin, Strategy


class RunInfoMixin:
    """Properties describing the run: strategy plugins, data options, save rules."""

    state: ProcessState
    strategy: Strategy
    dataloader_config: DataLoaderConfiguration
    mixed_precision: str

    @property
    def gradient_state(self) -> GradientState:
        """Where gradient accumulation and the dataloaders stand (Accelerate's
        ``GradientState``: ``sync_gradients``, ``end_of_dataloader``, ``active_dataloader``)."""
        return GradientState(accelerator=self)  # type: ignore[arg-type]

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeed options in use (``None`` unless training with DeepSpeed)."""
        return getattr(self.strategy, "plugin", None) if self.strategy.name == "deepspeed" else None

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        """The FSDP2 options in use (``None`` unless parameters are sharded with FSDP2)."""
        return getattr(self.strategy, "plugin", None) if self.is_fsdp2 else None

    @property
    def is_fsdp2(self) -> bool:
        """True when prepared models are sharded with FSDP2 (also inside a device mesh)."""
        if self.strategy.name == "fsdp":
            return True
        return self.strategy.name == "model_parallel" and bool(
            getattr(self.strategy, "shards", False)
        )

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """True for FSDP2 and N-D layouts (tensor/context/pipeline parallel with FSDP2)."""
        return self.is_fsdp2 or self.strategy.name == "model_parallel"

    @property
    def multi_device(self) -> bool:
        """True for several processes that each hold whole parameters (DDP, or tensor
        parallelism without sharding) on CPUs or GPUs."""
        return self.state.num_processes > 1 and self.strategy.distributed_type in (
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        )

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        """Always True in effect: prepared loaders shuffle with an agreed seed."""
        return True

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def should_save_model(self) -> bool:
        """Whether this process calls :meth:`save_model`: every process does (sharded
        strategies gather the weights collectively; only the main process writes)."""
        return True

    @property
    def fp8_backend(self) -> str:
        """``"TORCHAO"`` when training in fp8 (torchao's float8 layers), else ``"NO"``."""
        return "TORCHAO" if self.mixed_precision == "fp8" else "NO"

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when ``model`` (or a submodule) was dispatched over several devices with a
        device map (big-model inference): such a model cannot be prepared for training."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())
