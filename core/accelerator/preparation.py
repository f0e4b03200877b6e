"""The prepare() part of the Accelerator: models wrapped by the strategy, optimizers and
schedulers wrapped to step together, dataloaders sharded, in any order and any number of
calls, with clear errors for objects that cannot be prepared together."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..data.active_loaders import ActiveLoaders
from ..extensions import find_preparer
from ..optim.optimizer import AcceleratedOptimizer, StepCoordinator
from ..optim.scheduler import AcceleratedScheduler
from ..optim.step import StepState
from ..options.kwargs import DataLoaderConfiguration
from ..precision import Precision, restore_forward
from ..runtime.state import ProcessState
from ..strategies import Strategy
from .compile import TorchDynamoPlugin, compile_model
from .shared_state import GradientState, refuse_if_reset

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.utils.data import DataLoader

    from ..callbacks import CallbackRunner
    from ..data.loader import PreparedDataLoader


def _is_dataloader(obj: Any) -> bool:
    # No DataLoader can exist unless torch.utils.data was imported: check without importing.
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(obj, data.DataLoader)


def _is_prepared_loader(obj: Any) -> bool:
    loader = sys.modules.get("slipstream.data.loader")
    return loader is not None and isinstance(obj, loader.PreparedDataLoader)


class PrepareError(TypeError):
    """``prepare()`` got objects it cannot prepare together."""


def _optimizer_types() -> tuple[type, ...]:
    """Optimizers prepare() takes: torch's, and DeepSpeed's placeholder for one the config
    defines (its module loads on first prepare, not with slipstream)."""
    from ..strategies.deepspeed_plugin import DummyOptim

    return (torch.optim.Optimizer, DummyOptim)


def _is_scheduler(obj: Any) -> bool:
    from ..strategies.deepspeed_plugin import DummyScheduler

    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)):
        return True
    return isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer) and callable(
        getattr(obj, "step", None)
    )


class PreparationMixin:
    """prepare() and its one-object forms for the Accelerator."""

    # Provided by the Accelerator.
    state: ProcessState
    state_generation: int
    strategy: Strategy
    precision: Precision
    step_state: StepState
    coordinator: StepCoordinator
    active_loaders: ActiveLoaders
    callbacks: CallbackRunner
    dataloader_config: DataLoaderConfiguration
    dynamo_plugin: TorchDynamoPlugin
    device_placement: bool
    step_scheduler_with_optimizer: bool
    _models: list[nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedDataLoader]

    def prepare(self, *args: Any, device_placement: Sequence[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order.

        Models are placed on the device and wrapped for the active strategy, optimizers and
        schedulers wrapped, dataloaders sharded; anything else is returned unchanged. The
        results come back in the order given (a single object is returned as is). An object
        prepared before, here or by another Accelerator, comes back as it is and is
        registered with this Accelerator (checkpoints, ``free_memory``), as in Accelerate.

        Example::

            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            loader = accelerator.prepare(loader)    # already prepared: the same loader
        """
        refuse_if_reset(self.state_generation)
        if device_placement is not None and len(device_placement) != len(args):
            raise PrepareError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects; "
                "give one bool per object"
            )
        self._check_prepare_arguments(args)
        placements = list(device_placement or [self.device_placement] * len(args))
        results: list[Any] = list(args)

        # Objects an extension knows (e.g. torchmetrics metrics, which are nn.Modules too)
        # are handed to it rather than treated as models.
        extension = {i: p for i, obj in enumerate(args) if (p := find_preparer(obj)) is not None}
        for i, preparer in extension.items():
            results[i] = preparer.prepare(args[i], self)
        done = set(extension) | {
            i for i, obj in enumerate(args) if i not in extension and self._adopt_prepared(obj)
        }
        model_slots = [
            i for i, obj in enumerate(args) if isinstance(obj, nn.Module) and i not in done
        ]
        optimizer_types = _optimizer_types()
        optimizer_slots = [
            i for i, obj in enumerate(args) if isinstance(obj, optimizer_types) and i not in done
        ]
        if model_slots or optimizer_slots:
            models = [args[i] for i in model_slots]
            from ..big_modeling.offloaded_models import refuse_offloaded_quantized

            for model in models:
                refuse_offloaded_quantized(model)
            if self.strategy_autocasts:
                models = [self.precision.convert_model(m) for m in models]
            context: dict[str, Any] = {}
            if getattr(self.strategy, "steps_in_backward", False):
                # DeepSpeed builds its config from the batch size and schedulers it sees.
                context = {
                    "dataloaders": [a for a in args if _is_dataloader(a)] + list(self._dataloaders),
                    "schedulers": [a for a in args if _is_scheduler(a)],
                }
            wrapped, optimizers = self.strategy.setup(
                models,
                [args[i] for i in optimizer_slots],
                device_placement=[placements[i] for i in model_slots],
                **context,
            )
            for slot, model in zip(model_slots, wrapped, strict=True):
                if self.dynamo_plugin.backend != "no":
                    model = compile_model(model, self.dynamo_plugin)
                # Accelerate's marker: preparing the model again hands it back as it is.
                setattr(model, "_is_accelerate_prepared", True)  # noqa: B010
                results[slot] = model
                self._models.append(model)
            for slot, optimizer in zip(optimizer_slots, optimizers, strict=True):
                prepared = AcceleratedOptimizer(optimizer, self.coordinator, original=args[slot])
                setattr(prepared, "_is_accelerate_prepared", True)  # noqa: B010
                results[slot] = prepared
                self._optimizers.append(prepared)

        for i, obj in enumerate(args):
            if i in done:
                continue
            if _is_dataloader(obj):
                results[i] = self.prepare_data_loader(obj, device_placement=placements[i])
            elif _is_scheduler(obj):
                results[i] = self.prepare_scheduler(obj)

        return results[0] if len(results) == 1 else tuple(results)

    @property
    def strategy_autocasts(self) -> bool:
        return getattr(self.strategy, "autocast_forward", True)

    def _adopt_prepared(self, obj: Any) -> bool:
        """Whether ``obj`` was prepared before, here or by another Accelerator; it is then
        registered with this one (once) and handed back as it is."""
        if _is_prepared_loader(obj):
            if not any(obj is loader for loader in self._dataloaders):
                self._dataloaders.append(obj)
            # Its passes now count for this Accelerator (end of data for accumulation,
            # gather_for_metrics' duplicates, callbacks).
            obj.active_loaders = self.active_loaders
            return True
        if isinstance(obj, AcceleratedOptimizer):
            if not any(obj is opt for opt in self._optimizers):
                self._optimizers.append(obj)
            return True
        if isinstance(obj, AcceleratedScheduler):
            if not any(obj is scheduler for scheduler in self._schedulers):
                self._schedulers.append(obj)
            return True
        if isinstance(obj, nn.Module) and getattr(obj, "_slipstream_evaluation_only", False):
            # Prepared for evaluation only (no data-parallel wrapper): training wraps it now.
            self._models[:] = [model for model in self._models if model is not obj]
            delattr(obj, "_slipstream_evaluation_only")
            return False
        if isinstance(obj, nn.Module) and (
            getattr(obj, "_is_accelerate_prepared", False) is True
            or any(obj is model for model in self._models)
        ):
            if not any(obj is model for model in self._models):
                self._models.append(obj)
            # Optimizers prepared later find their model (after free_memory() too, as
            # transformers' Trainer calls it between evaluating and training).
            if not any(obj is model for model in self.strategy.prepared_models):
                self.strategy.prepared_models.append(obj)
            return True
        return False

    def _check_prepare_arguments(self, args: Sequence[Any]) -> None:
        seen: set[int] = set()
        for position, obj in enumerate(args):
            if id(obj) in seen:
                raise PrepareError(
                    f"prepare() got the same {type(obj).__name__} twice (argument {position}); "
                    "pass each object once"
                )
            seen.add(id(obj))
            # Prepared optimizers and schedulers step with their Accelerator's accumulation
            # (and loss scaling): handing another Accelerator's through would step them on
            # the wrong schedule.
            if isinstance(obj, AcceleratedOptimizer) and obj.coordinator is not self.coordinator:
                raise PrepareError(
                    f"argument {position} is an optimizer prepared by another Accelerator: it "
                    "steps with that Accelerator's gradient accumulation. Prepare the original "
                    "optimizer (prepared.optimizer) with this Accelerator, or keep using the "
                    "other one"
                )
            if isinstance(obj, AcceleratedScheduler) and obj.step_state is not self.step_state:
                raise PrepareError(
                    f"argument {position} is a scheduler prepared by another Accelerator: it "
                    "steps with that Accelerator's optimizers. Prepare the original scheduler "
                    "(prepared.scheduler) with this Accelerator, or keep using the other one"
                )
        schedulers = [
            obj
            for obj in args
            if _is_scheduler(obj) and not isinstance(obj, (nn.Module, AcceleratedScheduler))
        ]
        optimizers_here = {id(obj) for obj in args if isinstance(obj, _optimizer_types())}
        known = optimizers_here | {id(opt.optimizer) for opt in self._optimizers}
        known |= {id(opt.original) for opt in self._optimizers}
        for scheduler in schedulers:
            inner = getattr(scheduler, "optimizer", None)
            if isinstance(inner, AcceleratedOptimizer):
                inner = inner.optimizer
            if id(inner) not in known:
                raise PrepareError(
                    f"prepare() got a {type(scheduler).__name__} whose optimizer has not been "
                    "prepared; pass the optimizer to prepare() too (in the same or an earlier "
                    "call) so the scheduler steps with it"
                )

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        """Prepare one model (see :meth:`prepare`).

        ``evaluation_mode=True`` (Accelerate's, for a model that only runs inference) places
        the model, sets up mixed precision and ``torch.compile`` but adds no data-parallel
        wrapper; models whose parameters a strategy shards or splits (FSDP2, DeepSpeed,
        tensor/pipeline parallelism) are prepared in full, as they cannot run otherwise. A
        model prepared for evaluation is wrapped for training by a later :meth:`prepare`.

        Example::

            model = accelerator.prepare_model(model, evaluation_mode=True)
        """
        placement = self.device_placement if device_placement is None else device_placement
        if evaluation_mode and self.strategy.name in ("single", "ddp"):
            return self._prepare_for_evaluation(model, placement)
        return self.prepare(model, device_placement=[placement])

    def _prepare_for_evaluation(self, model: nn.Module, placement: bool) -> nn.Module:
        refuse_if_reset(self.state_generation)
        if self._adopt_prepared(model):
            return model
        if self.strategy_autocasts:
            model = self.precision.convert_model(model)
        if placement:
            model = model.to(self.state.device)
        if self.dynamo_plugin.backend != "no":
            model = compile_model(model, self.dynamo_plugin)
        setattr(model, "_slipstream_evaluation_only", True)  # noqa: B010
        self._models.append(model)
        return model

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = False
    ) -> nn.Module:
        """The user's module without the strategy's (and torch.compile's) wrappers.

        ``keep_torch_compile=True`` returns the compiled module when ``torch.compile``
        wrapped the user's module itself (no strategy wrapper between); a compiled wrapper
        around DDP is never rewired (Accelerate swaps its ``_orig_mod``): a new
        ``torch.compile`` wrapper of the user's module comes back instead. (Accelerate keeps
        the compiled module by default.)
        """
        inner = getattr(model, "_orig_mod", model)
        inner = self.strategy.unwrap_model(inner)
        while isinstance(inner, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = inner.module
        inner = getattr(inner, "_orig_mod", inner)
        if not keep_fp32_wrapper:
            restore_forward(inner)
        if keep_torch_compile and getattr(model, "_orig_mod", None) is inner:
            return model
        keep = keep_torch_compile and hasattr(model, "_orig_mod")
        return torch.compile(inner) if keep else inner  # type: ignore[return-value]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Prepare one optimizer (see :meth:`prepare`)."""
        return self.prepare(optimizer)

    def prepare_data_loader(
        self,
        data_loader: DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable[..., Any] | None = None,
    ) -> PreparedDataLoader:
        """Shard ``data_loader`` over the processes and place its batches on the device.

        ``slice_fn_for_dispatch`` (with ``dispatch_batches``) cuts each process's rows of a
        dispatched batch: ``slice_fn(batch, slice, process_index=, num_processes=)``. A loader
        prepared before comes back as it is (see :meth:`prepare`).

        Example::

            loader = accelerator.prepare_data_loader(DataLoader(ds, batch_size=8))
        """
        from ..data.prepare import shard_data_loader

        self._check_prepare_arguments([data_loader])
        if self._adopt_prepared(data_loader):
            return cast("PreparedDataLoader", data_loader)
        megatron_lm_plugin = getattr(self, "megatron_lm_plugin", None)
        if megatron_lm_plugin is not None:
            from .megatron import micro_batched

            data_loader = micro_batched(data_loader, megatron_lm_plugin)
        placement = self.device_placement if device_placement is None else device_placement
        controller = getattr(self, "fault_tolerance", None)
        if controller is not None:  # dealt over the live replica groups, step by step
            return controller.prepare_loader(
                data_loader,
                self.state.device if placement else None,
                self.dataloader_config.data_seed,
            )
        if (
            not self.dataloader_config.even_batches
            and self.strategy.forward_is_collective
            and self.state.data_parallel_size > 1
        ):
            warnings.warn(
                "even_batches=False gives processes different numbers of batches, but with "
                f"{self.strategy.name} every forward of a prepared model is a collective: a "
                "process that runs out of batches leaves the others waiting. Keep "
                "even_batches=True (gather_for_metrics drops the repeated samples), or do not "
                "run the model on this loader's batches",
                stacklevel=2,
            )
        prepared = shard_data_loader(
            data_loader,
            state=self.state,
            split_batches=self.dataloader_config.split_batches,
            even_batches=self.dataloader_config.even_batches,
            device_placement=placement,
            non_blocking=self.dataloader_config.non_blocking,
            active_loaders=self.active_loaders,
            dispatch_batches=self.dataloader_config.dispatch_batches,
            use_stateful_dataloader=self.dataloader_config.use_stateful_dataloader,
            data_seed=self.dataloader_config.data_seed,
            slice_fn=slice_fn_for_dispatch,
        )
        self._dataloaders.append(prepared)
        return prepared

    def _dataloader_pass_ended(self, loader: PreparedDataLoader) -> None:
        """A prepared loader finished a whole pass: the callbacks' hook. (A method, not a
        lambda, so an Accelerator holding prepared loaders pickles.)"""
        self.callbacks.call("on_dataloader_epoch_end", self, loader)

    def _current_gradient_state(self) -> GradientState:
        """A prepared loader's ``gradient_state`` (Accelerate's loaders have one)."""
        return self.gradient_state  # type: ignore[attr-defined]

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap an LR scheduler so it steps with its prepared optimizer (one prepared before
        comes back as it is).

        Example::

            scheduler = accelerator.prepare_scheduler(StepLR(optimizer, step_size=10))
        """
        self._check_prepare_arguments([scheduler])
        if self._adopt_prepared(scheduler):
            return scheduler
        inner = scheduler.optimizer
        owners = [
            opt
            for opt in self._optimizers
            if opt.optimizer is inner or opt is inner or opt.original is inner
        ]
        steps = 1 if self.dataloader_config.split_batches else self.state.data_parallel_size
        controller = getattr(self, "fault_tolerance", None)
        if controller is not None and not self.dataloader_config.split_batches:
            # Per committed step, whatever the quorum: the job's full data-parallel size, as
            # the same processes without fault tolerance would step it.
            steps *= controller.replica_groups
        prepared = AcceleratedScheduler(
            scheduler,
            owners,
            self.step_state,
            steps_per_optimizer_step=steps,
            step_with_optimizer=self.step_scheduler_with_optimizer,
        )
        setattr(prepared, "_is_accelerate_prepared", True)  # noqa: B010
        self._schedulers.append(prepared)
        return prepared
