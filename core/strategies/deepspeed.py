"""DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) as a slipstream strategy.

The DeepSpeed engine owns the optimizer step, loss scaling, gradient clipping and the
partitioning of states; the strategy builds its config from what ``prepare()`` sees and
routes ``backward``, ``accumulate`` and checkpoints through it. On machines without GPUs
DeepSpeed runs on its CPU accelerator over gloo.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..runtime.env import provide_local_rank
from ..runtime.state import DistributedType, ProcessState
from .base import Strategy, share_router_statistics
from .deepspeed_plugin import DeepSpeedConfigError, DeepSpeedPlugin, DummyOptim, DummyScheduler

if TYPE_CHECKING:
    from ..checkpoint.io import CheckpointReader, CheckpointWriter

CHECKPOINT_TAG = "pytorch_model"


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError:
        raise ImportError(
            "DeepSpeed is not installed: pip install setuptools wheel && pip install "
            "--no-build-isolation 'slipstream[deepspeed]' (without build isolation so that "
            "it builds against the torch you have)"
        ) from None
    return deepspeed


class DeepSpeedStrategy(Strategy):
    """One model trained by a DeepSpeed engine. Options: a :class:`DeepSpeedPlugin`."""

    name: ClassVar[str] = "deepspeed"
    autocast_forward: ClassVar[bool] = False
    #: The engine scales losses and casts weights itself (bf16/fp16 from mixed_precision).
    manages_precision: ClassVar[bool] = True
    #: The engine steps the optimizer inside backward at accumulation boundaries.
    steps_in_backward: ClassVar[bool] = True

    def __init__(
        self,
        state: ProcessState,
        plugin: DeepSpeedPlugin | None = None,
        mixed_precision: str = "no",
        gradient_accumulation_steps: int = 1,
        split_batches: bool = False,
    ) -> None:
        super().__init__(state)
        self.deepspeed = import_deepspeed()
        self.plugin = plugin or DeepSpeedPlugin()
        self.forward_is_collective = self.plugin.zero_stage == 3
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.split_batches = split_batches
        self.engine: Any = None
        self.config: dict[str, Any] = {}
        if mixed_precision not in ("no", "bf16", "fp16"):
            raise DeepSpeedConfigError(
                f"DeepSpeed supports mixed_precision no, bf16 or fp16, not {mixed_precision!r}"
            )
        backend = "nccl" if state.device.type == "cuda" else "gloo"
        if state.num_processes == 1:
            provide_local_rank()  # `python train.py`: no launcher set it
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                backend, store=torch.distributed.HashStore(), rank=0, world_size=1
            )
        self.deepspeed.init_distributed(dist_backend=backend)

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.DEEPSPEED

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.mixed_precision, torch.float32
        )

    # -- building the engine ----------------------------------------------------------------
    def setup(
        self,
        models: list[nn.Module],
        optimizers: list[Any],
        *,
        device_placement: list[bool],
        **context: Any,
    ) -> tuple[list[nn.Module], list[Any]]:
        dataloaders: list[Any] = list(context.get("dataloaders", []))
        schedulers: list[Any] = list(context.get("schedulers", []))
        if len(models) != 1 or self.engine is not None:
            raise DeepSpeedConfigError(
                "DeepSpeed trains one model per Accelerator: prepare exactly one model (with "
                f"its optimizer) once; got {len(models)} model(s)"
                + (" after one was already prepared" if self.engine is not None else "")
            )
        if len(optimizers) > 1:
            raise DeepSpeedConfigError("DeepSpeed takes one optimizer; prepare only one")
        model = models[0]
        optimizer = optimizers[0] if optimizers else None
        if (
            optimizer is not None
            and not isinstance(optimizer, DummyOptim)
            and (self.plugin.config_defines_optimizer)
        ):
            raise DeepSpeedConfigError(
                'the DeepSpeed config defines "optimizer" and prepare() got a '
                f"{type(optimizer).__name__} too; remove the config's optimizer or pass "
                "DummyOptim(model.parameters()) to prepare()"
            )
        if isinstance(optimizer, DummyOptim) and not self.plugin.config_defines_optimizer:
            raise DeepSpeedConfigError(
                'DummyOptim needs an "optimizer" section in the DeepSpeed config; add one or '
                "pass a torch optimizer"
            )
        self.config = self.plugin.build_config(
            micro_batch_size=self._micro_batch_size(dataloaders),
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            world_size=self.state.num_processes,
            mixed_precision=self.mixed_precision,
            optimizer_defaults=self._optimizer_defaults(optimizer),
            scheduler_values=self._scheduler_values(schedulers),
        )
        if optimizer is not None and not isinstance(optimizer, DummyOptim):
            # The user chose a torch optimizer: let ZeRO use it (offloaded too) instead of
            # insisting on DeepSpeed's own compiled ones.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)
            self.config.setdefault("zero_allow_untested_optimizer", True)
        self._cast_io(model)
        share_router_statistics(model, self.state)
        engine_scheduler = next((s for s in schedulers if isinstance(s, DummyScheduler)), None)
        self.engine, engine_optimizer, _, _ = self.deepspeed.initialize(
            model=model,
            optimizer=None if isinstance(optimizer, DummyOptim) else optimizer,
            model_parameters=optimizer.params if isinstance(optimizer, DummyOptim) else None,
            # A scheduler of the user's built on the engine's optimizer (the JSON has none).
            lr_scheduler=getattr(engine_scheduler, "lr_scheduler_callable", None),
            config=self.config,
        )
        if engine_scheduler is not None:
            engine_scheduler.engine_scheduler = self.engine.lr_scheduler
        return [self.engine], [engine_optimizer] if optimizer is not None else []

    def _micro_batch_size(self, dataloaders: Iterable[Any]) -> int | None:
        for loader in dataloaders:
            size = getattr(loader, "batch_size", None)
            if size:
                return size // self.state.num_processes if self.split_batches else size
        return None

    @staticmethod
    def _optimizer_defaults(optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, DummyOptim):
            return {"lr": optimizer.lr, "weight_decay": optimizer.weight_decay, **optimizer.kwargs}
        if optimizer is not None:
            defaults = optimizer.defaults
            return {k: defaults[k] for k in ("lr", "weight_decay", "betas", "eps") if k in defaults}
        return {}

    @staticmethod
    def _scheduler_values(schedulers: Iterable[Any]) -> dict[str, Any]:
        for scheduler in schedulers:
            if isinstance(scheduler, DummyScheduler):
                values: dict[str, Any] = {"warmup_num_steps": scheduler.warmup_num_steps}
                if scheduler.total_num_steps is not None:
                    values["total_num_steps"] = scheduler.total_num_steps
                return {**values, **scheduler.kwargs}
        return {}

    def _cast_io(self, model: nn.Module) -> None:
        """The engine stores bf16/fp16 weights: cast floating inputs to match and outputs
        back to fp32, so a plain fp32 script keeps working."""
        if self.compute_dtype == torch.float32:
            return
        from ..precision.base import patch_forward_with
        from ..runtime.tree import map_tensors

        dtype = self.compute_dtype
        patch_forward_with(
            model,
            contextlib.nullcontext,
            convert_outputs_to_fp32=True,
            convert_inputs=lambda inputs: map_tensors(
                lambda t: t.to(dtype) if torch.is_floating_point(t) else t, inputs
            ),
        )

    def model_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """``deepspeed.zero.Init`` when ``zero3_init_flag`` is on at stage 3."""
        if self.plugin.zero3_init_flag and self.plugin.zero_stage == 3:
            dtype = self.compute_dtype
            return self.deepspeed.zero.Init(
                dtype=dtype,
                config_dict_or_path={
                    "zero_optimization": {"stage": 3},
                    "train_micro_batch_size_per_gpu": 1,
                    "bf16": {"enabled": dtype == torch.bfloat16},
                    "fp16": {"enabled": dtype == torch.float16},
                },
            )
        return contextlib.nullcontext()

    # -- training step ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        sync = self.step_state.sync_gradients if self.step_state is not None else True
        self.engine.set_gradient_accumulation_boundary(sync)
        # The Accelerator (or transformers' Trainer, which also passes scale_wrt_gas=False)
        # already divided the loss by the micro-batches of the cycle.
        kwargs.pop("scale_wrt_gas", None)
        self.engine.backward(loss, scale_wrt_gas=False, **kwargs)
        self.engine.step()

    def step_was_skipped(self) -> bool:
        return not self.engine.was_step_applied()

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        yield  # accumulation boundaries are set on the engine in backward

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clipping happens inside the engine's step: ``max_norm`` becomes its clipping
        value; returns the global norm of the last applied step (NaN before the first)."""
        if norm_type != 2.0:
            raise DeepSpeedConfigError("DeepSpeed clips by the 2-norm only")
        if math.isfinite(max_norm):  # an infinite max_norm asks for the norm only
            self.engine._config.gradient_clipping = float(max_norm)
        norm = self.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    # -- weights ------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Full weights: at ZeRO-3 the consolidated 16-bit state dict (collective)."""
        engine: Any = model if hasattr(model, "zero_optimization_stage") else self.engine
        if engine.zero_optimization_stage() == 3:
            if not self.plugin.zero3_save_16bit_model:
                raise DeepSpeedConfigError(
                    "at ZeRO-3 the weights are partitioned over the processes; set "
                    "zero3_save_16bit_model: true (stage3_gather_16bit_weights_on_model_save) to "
                    "gather them, or use save_state + `slipstream merge-weights`"
                )
            consolidated = engine._zero3_consolidated_16bit_state_dict()
            return dict(consolidated) if consolidated is not None else {}  # main process only
        return dict(engine.module.state_dict())

    def checkpoint_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {}  # the engine writes its own (partitioned) checkpoint

    def save_model_checkpoint(
        self, model: nn.Module, state_dict: dict[str, Any], writer: CheckpointWriter, index: int
    ) -> None:
        if not writer.storage.is_local:
            raise DeepSpeedConfigError(
                "DeepSpeed writes checkpoints to local (or shared) filesystem paths only; "
                f"got {writer.storage.url(writer.folder)}"
            )
        self.engine.save_checkpoint(writer.folder, tag=CHECKPOINT_TAG)
        if self.state.is_main_process:
            writer.written += [CHECKPOINT_TAG, "latest"]

    def load_model_checkpoint(
        self, model: nn.Module, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        reader.require(CHECKPOINT_TAG, "the DeepSpeed engine checkpoint")
        saved = int(reader.manifest.get("num_processes", self.state.num_processes))
        if saved != self.state.num_processes and self.plugin.zero_stage > 0:
            raise DeepSpeedConfigError(
                f"{reader.storage.url(reader.folder)} was saved by {saved} processes, and a "
                f"DeepSpeed ZeRO checkpoint loads only on as many; this job has "
                f"{self.state.num_processes}. Resume with {saved} processes, or convert it to "
                "DeepSpeed's universal checkpoint (deepspeed.checkpoint.ds_to_universal) and "
                "load that, or use FSDP2 (its checkpoints load on any number of processes)"
            )

        def apply() -> None:
            path, _ = self.engine.load_checkpoint(reader.folder, tag=CHECKPOINT_TAG)
            if path is None:
                raise DeepSpeedConfigError(f"DeepSpeed could not load {reader.folder}")

        return apply

    def save_optimizer_checkpoint(
        self, optimizer: Any, writer: CheckpointWriter, index: int
    ) -> None:
        """Saved with the engine checkpoint."""

    def load_optimizer_checkpoint(
        self, optimizer: Any, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        return lambda: None  # loaded with the engine checkpoint

    def teardown(self) -> None:
        self.engine = None
