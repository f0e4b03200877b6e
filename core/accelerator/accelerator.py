"""The Accelerator: the four-line front door to slipstream.

A facade: the process state knows who we are, the strategy wraps models, the precision
object runs autocast and loss scaling, the data package shards loaders, collectives move data.

Example::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ..callbacks import CallbackRunner
from ..data.active_loaders import ActiveLoaders
from ..optim.optimizer import AcceleratedOptimizer, StepCoordinator
from ..optim.scheduler import AcceleratedScheduler
from ..options.kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from ..parallel.api import ParallelMixin
from ..precision import Precision, canonical_mode, make_precision
from ..runtime import collectives
from ..runtime.preemption import DEFAULT_SIGNALS, PreemptionHandler
from ..runtime.process_control import ProcessControl
from ..runtime.state import DistributedType, join_or_build_state, shared_state_generation
from ..runtime.tree import map_tensors, tensor_leaves
from ..strategies import available_strategies, get_strategy_class
from ..tracking import GeneralTracker, check_logging_directories, resolve_log_with
from ..tracking.api import TrackingMixin
from . import adopt, megatron
from .assembly import (
    STRATEGY_FOR_TYPE,
    build_dynamo_plugin,
    build_step_state,
    build_strategy,
    warn_about_rng_types,
    xla_strategy_name,
)
from .checkpointing import CheckpointingMixin
from .compile import TorchDynamoPlugin
from .preparation import PreparationMixin
from .profiling import ProfilingMixin
from .run_info import RunInfoMixin
from .shared_state import note_accelerator
from .training_step import TrainingStepMixin
from .uneven_inputs import UnevenInputsMixin

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from ..data.loader import PreparedDataLoader
    from ..options.fault_tolerance import FaultToleranceKwargs
    from ..parallel.config import ParallelismConfig
    from ..strategies.deepspeed_plugin import DeepSpeedPlugin
    from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin
    from ..strategies.megatron_plugin import MegatronLMPlugin
    from .checkpointer import LoadHook, SaveHook

F = TypeVar("F", bound=Callable[..., Any])


class Accelerator(
    ProcessControl,
    PreparationMixin,
    TrainingStepMixin,
    CheckpointingMixin,
    TrackingMixin,
    ParallelMixin,
    RunInfoMixin,
    ProfilingMixin,
    UnevenInputsMixin,
):
    """Runs one training script on a CPU, several processes, GPUs or machines.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: split each batch across processes (the global batch keeps the
            script's size) instead of giving each process a batch of that size.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; defaults to the launcher's
            ``--mixed_precision``, else ``"no"``.
        gradient_accumulation_steps: micro-batches per optimizer step (see :meth:`accumulate`).
        cpu: use the CPU even when GPUs are present.
        even_batches: complete the final global batch so all processes take equal steps.
        dataloader_config: a :class:`DataLoaderConfiguration` (alternative to the two above).
        kwargs_handlers: option objects such as :class:`DistributedDataParallelKwargs`.
        step_scheduler_with_optimizer: step prepared schedulers only with the optimizer.
        debug: check every collective for matching calls on all ranks.
        dynamo_backend: compile prepared models with ``torch.compile`` and this backend.
        dynamo_plugin: a :class:`TorchDynamoPlugin` with all ``torch.compile`` settings.
        project_dir: where checkpoints (and logs) of this run go.
        project_config: a :class:`ProjectConfiguration` (automatic checkpoint naming, rotation).
        fsdp_plugin: shard models with FSDP2 using these options (also chosen by
            ``distributed_type: FSDP`` with an ``fsdp_config`` block in the config file).
        deepspeed_plugin: train with DeepSpeed ZeRO using these options (also chosen by
            ``distributed_type: DEEPSPEED`` with a ``deepspeed_config`` block).
        megatron_lm_plugin: Accelerate's Megatron-LM options, run on tensor, sequence and
            pipeline parallelism with FSDP2 (also a ``megatron_lm_config`` block); see
            docs/megatron.md.
        parallelism_config: arrange the processes in a device mesh with tensor, context and
            (hybrid) sharded data parallelism (also read from a ``parallelism_config`` block);
            see :class:`slipstream.ParallelismConfig`.
        save_on_preemption: on a preemption signal, every process saves a checkpoint into
            ``project_dir`` at the next optimizer step and the job exits with code 75 for a
            requeue; ``load_state("latest")`` resumes (also ``--save_on_preemption``).
        preemption_signals: the signals that mean preemption (default SIGTERM and SIGUSR1).
        log_with: experiment trackers ("csv", "tensorboard", "wandb", "mlflow", "all" or
            GeneralTracker objects), started by :meth:`init_trackers`.
        callbacks: objects whose hook methods are called during training (see
            :class:`slipstream.Callback`).
        gradient_accumulation_plugin: a :class:`GradientAccumulationPlugin` (accumulation
            steps plus when cycles end and whether every micro-batch synchronises).
        rng_types: accepted for Accelerate scripts. Shuffles are seeded alike on every
            process, so no RNG needs synchronising each epoch; asking for the global
            ``"torch"``/``"cuda"`` RNGs warns (call ``synchronize_rng_states`` yourself
            where identical random streams are wanted).
        hang_timeout: seconds (or a timedelta) without an optimizer step or a finished
            collective after which every process reports what it is doing and the job ends
            with exit code 86 (see docs/misbehaving.md); default: a little under the process
            group's timeout on several processes, off for one; 0 switches it off. Also
            ``--hang_timeout`` and ``SLIPSTREAM_HANG_TIMEOUT``.
        fault_tolerance: a :class:`FaultToleranceKwargs`: replica groups drop out and
            rejoin per step with torchft (also ``slipstream launch --fault_tolerance``); see
            docs/fault-tolerance.md.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        even_batches: bool | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        step_scheduler_with_optimizer: bool = True,
        debug: bool | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        megatron_lm_plugin: MegatronLMPlugin | None = None,
        log_with: str | GeneralTracker | Sequence[str | GeneralTracker] | None = None,
        callbacks: Sequence[Any] | None = None,
        parallelism_config: ParallelismConfig | None = None,
        save_on_preemption: bool | None = None,
        preemption_signals: str | Sequence[str] | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        rng_types: Sequence[str] | None = None,
        hang_timeout: float | timedelta | None = None,
        fault_tolerance: FaultToleranceKwargs | None = None,
    ) -> None:
        warn_about_rng_types(rng_types)
        # Accelerate's option objects (transformers' Trainer passes them) become slipstream's.
        handlers = {type(h): h for h in adopt.kwargs_handlers(kwargs_handlers)}
        dataloader_config = adopt.dataloader_config(dataloader_config)
        gradient_accumulation_plugin = adopt.accumulation_plugin(gradient_accumulation_plugin)
        dynamo_plugin, project_config = (
            adopt.dynamo_plugin(dynamo_plugin),
            adopt.project_config(project_config),
        )
        fsdp_plugin, deepspeed_plugin = (
            adopt.fsdp_plugin(fsdp_plugin),
            adopt.deepspeed_plugin(deepspeed_plugin),
        )
        parallelism_config = adopt.parallelism_config(parallelism_config)
        init_kwargs = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        self.state = join_or_build_state(cpu, debug=debug, **vars(init_kwargs))
        self.state_generation = shared_state_generation()  # see AcceleratorState._reset_state
        launch = dict(self.state.launch.launch_config)

        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not None:
            self.dataloader_config.split_batches = split_batches
        if even_batches is not None:
            self.dataloader_config.even_batches = even_batches
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer

        self.step_state = build_step_state(
            gradient_accumulation_steps,
            gradient_accumulation_plugin,
            launch,
            self.state.num_processes,
        )
        autocast = handlers.get(AutocastKwargs, AutocastKwargs())
        scaler = handlers.get(GradScalerKwargs)
        assert isinstance(autocast, AutocastKwargs)
        mode = canonical_mode(mixed_precision or launch.get("mixed_precision") or "no")
        self.megatron_lm_plugin = megatron.megatron_plugin_for(megatron_lm_plugin, launch)
        if self.megatron_lm_plugin is not None:
            parallelism_config = megatron.megatron_layout(
                self.megatron_lm_plugin, parallelism_config, deepspeed_plugin, self.state, launch
            )
        self.parallelism_config = self._parallelism_config(parallelism_config, launch)
        strategy_name = self._strategy_name(launch, fsdp_plugin, deepspeed_plugin)
        known = strategy_name in available_strategies()
        strategy_class = get_strategy_class(strategy_name) if known else None
        # A strategy that manages precision itself (DeepSpeed) gets the mode in its config;
        # the Accelerator then runs without autocast or a loss scaler of its own.
        runtime_mode = "no" if getattr(strategy_class, "manages_precision", False) else mode
        self.precision: Precision = make_precision(
            runtime_mode,
            self.state.device,
            convert_outputs_to_fp32=autocast.convert_outputs_to_fp32,
            autocast_enabled=autocast.enabled,
            cache_enabled=autocast.cache_enabled,
            scaler_kwargs=scaler.to_kwargs() if scaler is not None else None,
        )
        self.mixed_precision = mode
        self.dynamo_plugin = build_dynamo_plugin(dynamo_backend, dynamo_plugin, launch)
        profile = handlers.get(ProfileKwargs)
        self.profile_handler = profile if isinstance(profile, ProfileKwargs) else None
        self.strategy = build_strategy(
            strategy_name,
            self.state,
            launch,
            handlers,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            autocast=autocast,
            mixed_precision=self.mixed_precision,
            parallelism=self.parallelism_config,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            split_batches=self.split_batches,
        )
        self.strategy.step_state = self.step_state
        megatron.configure_strategy(self.strategy, self.megatron_lm_plugin)
        self.state.distributed_type = self.strategy.distributed_type  # what scripts read
        self.state.fsdp_plugin, self.state.deepspeed_plugin = (
            self.fsdp_plugin,
            self.deepspeed_plugin,
        )
        if self.step_state.sync_each_batch and self.strategy.name == "deepspeed":
            raise ValueError(
                "GradientAccumulationPlugin(sync_each_batch=True) does not apply to DeepSpeed: "
                "its engine reduces gradients at its own accumulation boundaries. Remove it"
            )
        self.coordinator = StepCoordinator(
            self.step_state,
            self.precision.scaler,
            self.strategy if getattr(self.strategy, "steps_in_backward", False) else None,
        )
        if hasattr(self.strategy, "after_optimizer_step"):  # XLA: the step barrier
            self.coordinator.device_step = self.strategy
        self.callbacks = CallbackRunner([*(callbacks or ()), *megatron.callbacks(self)])
        self.coordinator.callbacks = self.callbacks
        self.coordinator.hook_owner = self
        self.log_with = resolve_log_with(log_with)
        self.trackers: list[GeneralTracker] = []
        self.active_loaders = ActiveLoaders()
        self.active_loaders.on_pass_end = self._dataloader_pass_ended  # a method: pickles
        self.active_loaders.gradient_state = self._current_gradient_state
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        check_logging_directories(self.log_with, self.project_configuration.logging_dir)
        self._custom_objects: list[Any] = []
        self._save_hooks: dict[int, SaveHook] = {}
        self._load_hooks: dict[int, LoadHook] = {}
        self._preemption = self._preemption_handler(save_on_preemption, preemption_signals, launch)
        from ..diagnostics.hang import watch_for_hangs  # loaded by the Accelerator, not import

        watch_for_hangs(self.state, hang_timeout, launch, self.project_configuration)
        self.fault_tolerance: Any = None
        if fault_tolerance is not None or launch.get("fault_tolerance_config"):
            from ..fault_tolerance import build_fault_tolerance

            layout = (self.strategy.distributed_type.value, self.parallelism_config)
            self.fault_tolerance = build_fault_tolerance(
                fault_tolerance, launch, self.state, layout
            )
            if self.fault_tolerance is not None:
                self.fault_tolerance.attach(self)
        note_accelerator(self)

    def _preemption_handler(
        self,
        enabled: bool | None,
        signals: str | Sequence[str] | None,
        launch: dict[str, Any],
    ) -> PreemptionHandler | None:
        if enabled is None:
            enabled = bool(launch.get("save_on_preemption", False))
        if not enabled:
            return None
        if not self.project_configuration.project_dir:
            raise ValueError(
                "save_on_preemption needs project_dir=... (or a ProjectConfiguration with one): "
                "the checkpoint goes to {project_dir}/checkpoints, where "
                "load_state('latest') finds it"
            )
        self.project_configuration.automatic_checkpoint_naming = True
        chosen = signals or launch.get("preemption_signals") or DEFAULT_SIGNALS
        handler = PreemptionHandler(
            self.state, list(chosen) if not isinstance(chosen, str) else chosen
        )
        handler.install()
        self.active_loaders.before_batch = self._check_preemption
        return handler

    def _check_preemption(self) -> None:
        """At a batch boundary: save and stop if the job is being preempted. Only between
        optimizer steps (not inside an accumulation cycle), so the checkpoint resumes
        exactly."""
        handler = self._preemption
        if handler is None or not self.step_state.sync_gradients or self.coordinator.pending:
            return
        if handler.should_stop(self.step):

            def finish() -> None:
                for tracker in self.trackers:
                    tracker.finish()

            handler.stop(save=lambda: self.save_state(), finish=finish)

    def _strategy_name(
        self,
        launch: dict[str, Any],
        fsdp_plugin: FullyShardedDataParallelPlugin | None,
        deepspeed_plugin: DeepSpeedPlugin | None,
    ) -> str:
        if fsdp_plugin is not None and deepspeed_plugin is not None:
            raise ValueError("pass fsdp_plugin or deepspeed_plugin, not both")
        requested = STRATEGY_FOR_TYPE.get(str(launch.get("distributed_type", "")).upper())
        if self.state.device.type == "xla":  # PJRT_DEVICE or slipstream launch --tpu
            plugin = fsdp_plugin or deepspeed_plugin or self.parallelism_config
            return xla_strategy_name(requested, plugin)
        if deepspeed_plugin is not None or (fsdp_plugin is None and requested == "deepspeed"):
            self._check_deepspeed_layout()
            return "deepspeed"
        if self.parallelism_config is not None:
            return "model_parallel"
        if fsdp_plugin is not None:
            return "fsdp"
        return requested or ("ddp" if self.state.num_processes > 1 else "single")

    # -- who am I ---------------------------------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        return self.strategy.distributed_type

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.step_state.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.step_state.set_accumulation(steps)

    @property  # settable too, as Accelerate's
    def sync_gradients(self) -> bool:
        """True when the current micro-step synchronises gradients and steps the optimizer."""
        return self.step_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.step_state.sync_gradients = bool(value)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.step_state.optimizer_steps

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 gradient overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def scaler(self) -> Any:
        return self.precision.scaler

    # -- models -------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict of a prepared model (collective for sharded strategies)."""
        return self.strategy.model_state_dict(model)

    # -- collectives --------------------------------------------------------------------------
    # They work over the data-parallel processes: under tensor, context or pipeline
    # parallelism the processes of one group hold the same samples, and counting each once
    # is what makes gathered predictions and reduced losses right.
    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors from all data-parallel processes along dim 0 (see
        :func:`slipstream.gather`)."""
        return collectives.gather(tensor, state=self.state.data_parallel)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions/labels and drop the samples duplicated to even out the final
        batch, so metrics see every sample of the evaluation set exactly once."""
        state = self.state.data_parallel
        loader = self.active_loaders.innermost
        has_tensors = bool(tensor_leaves(input_data))
        rows = loader.real_rows if loader is not None and loader.dispatch is None else None
        if rows is not None:
            # A stream read in parts: this process's batch was completed with repeats.
            if use_gather_object or not has_tensors:
                return collectives.gather_object(list(input_data)[:rows], state=state)
            return collectives.gather_uneven(
                map_tensors(lambda t: t[:rows], input_data), state=state
            )
        if use_gather_object or not has_tensors:
            gathered: Any = collectives.gather_object(input_data, state=state)
        elif loader is not None and loader.end_of_dataloader and loader.uneven_tail:
            gathered = collectives.gather_uneven(input_data, state=state)
        else:
            gathered = collectives.gather(input_data, state=state)
        # The final global batch's real samples: the rest repeat samples to even out
        # processes, or (one process) rows a loop padded to the batch size, as Trainer's
        # `loss.repeat(batch_size)` does (Accelerate cuts both to gradient_state.remainder).
        real = loader.final_real_samples if loader is not None else None
        if real is None:
            return gathered
        if isinstance(gathered, list) and (use_gather_object or not has_tensors):
            return gathered[:real]
        return map_tensors(lambda t: t[:real], gathered)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average tensors over the data-parallel processes (see
        :func:`slipstream.reduce`)."""
        return collectives.reduce(tensor, reduction, scale, state=self.state.data_parallel)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size on any data-parallel process."""
        return collectives.pad_across_processes(
            tensor, dim, pad_index, pad_first, state=self.state.data_parallel
        )

    def skip_first_batches(self, dataloader: DataLoader[Any], num_batches: int = 0) -> Any:
        """The loader, set to start its next pass after ``num_batches`` batches."""
        from ..data.prepare import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop references to everything prepared, collect garbage and empty device caches.

        Returns ``None`` for each object passed, so ``model, opt = accelerator.free_memory(
        model, opt)`` releases the caller's references too.
        """
        self._models.clear()
        self._optimizers.clear()
        self.coordinator.optimizers.clear()
        self.coordinator.pending.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.strategy.teardown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type.value}, "
            f"num_processes={self.num_processes}, device={self.device}, "
            f"mixed_precision={self.mixed_precision})"
        )
