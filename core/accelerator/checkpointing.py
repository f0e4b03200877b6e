"""The Accelerator's checkpoint methods: save_state, load_state, save_model, hooks.

Mixed into the Accelerator; the work happens in :class:`~slipstream.checkpoint.Checkpointer`
and :mod:`slipstream.checkpoint.weights`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..callbacks import CallbackRunner
from ..optim.optimizer import AcceleratedOptimizer, StepCoordinator
from ..optim.scheduler import AcceleratedScheduler
from ..optim.step import StepState
from ..options.kwargs import ProjectConfiguration
from ..runtime.state import ProcessState
from ..strategies import Strategy

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, LoadHook, SaveHook, TrainingObjects


class _HookHandle:
    """Returned by the ``register_*_hook`` methods; ``remove()`` unregisters the hook."""

    _next_id = 0

    def __init__(self, hooks: dict[int, Any], hook: Any) -> None:
        _HookHandle._next_id += 1
        self.id = _HookHandle._next_id
        self.hooks = hooks
        hooks[self.id] = hook

    def remove(self) -> None:
        self.hooks.pop(self.id, None)


class CheckpointingMixin:
    """save_state/load_state and model weights for the Accelerator."""

    @property
    def checkpointer(self) -> Checkpointer:
        """Built on first use (keeps fsspec and safetensors out of ``import slipstream``)."""
        existing = self.__dict__.get("_checkpointer")
        if existing is None:
            from .checkpointer import Checkpointer

            existing = Checkpointer(self.state, self.strategy, self.project_configuration)
            self.__dict__["_checkpointer"] = existing
        return existing

    # Provided by the Accelerator.
    state: ProcessState
    project_configuration: ProjectConfiguration
    strategy: Strategy
    step_state: StepState
    coordinator: StepCoordinator
    mixed_precision: str
    _models: list[nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[Any]
    _custom_objects: list[Any]
    _save_hooks: dict[int, SaveHook]
    _load_hooks: dict[int, LoadHook]
    callbacks: CallbackRunner

    @property
    def scaler(self) -> Any:
        raise NotImplementedError

    def get_state_dict(self, model: nn.Module) -> dict[str, Any]:
        raise NotImplementedError

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        raise NotImplementedError

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration

    def _training_objects(self) -> TrainingObjects:
        from .checkpointer import TrainingObjects

        return TrainingObjects(
            models=[getattr(m, "_orig_mod", m) for m in self._models],
            optimizers=[opt.optimizer for opt in self._optimizers],
            schedulers=self._schedulers,
            dataloaders=self._dataloaders,
            scaler=self.scaler,
            step_state=self.step_state,
            custom=self._custom_objects,
            save_hooks=list(self._save_hooks.values()),
            load_hooks=list(self._load_hooks.values()),
            strategy_name=self.strategy.name,
            mixed_precision=self.mixed_precision,
            extra_state=self._callback_state,
            restore_extra=self._restore_callback_state,
        )

    def _callback_state(self) -> dict[str, Any]:
        """Each callback's ``on_save_checkpoint`` fills its own dict (keyed by class and
        position)."""
        state: dict[str, Any] = {}
        for key, callback in zip(
            self.callbacks.state_keys(), self.callbacks.callbacks, strict=True
        ):
            if hasattr(callback, "on_save_checkpoint"):
                state[key] = {}
                self.callbacks.call_one(callback, "on_save_checkpoint", self, state[key])
        return state

    def _restore_callback_state(self, state: dict[str, Any]) -> None:
        for key, callback in zip(
            self.callbacks.state_keys(), self.callbacks.callbacks, strict=True
        ):
            if key in state and hasattr(callback, "on_load_checkpoint"):
                self.callbacks.call_one(callback, "on_load_checkpoint", self, state[key])

    def save_state(self, output_dir: str | None = None, async_save: bool = False, **_: Any) -> str:
        """Save everything needed to resume training exactly; returns where it went.

        ``output_dir`` is a local path or any fsspec URL (``s3://``, ``memory://``...); with
        automatic checkpoint naming it may be omitted. The checkpoint appears only once every
        process has written its part. Must be called on every process. With ``async_save``
        the call returns after taking a CPU snapshot; the files are written in the
        background and committed by :meth:`wait_for_checkpoint` (or the next save/load, or
        ``end_training``).
        """
        self.coordinator.finish()
        controller = getattr(self, "fault_tolerance", None)
        # Semi-synchronous training: the state the open interval started from.
        view = controller.checkpoint_view() if controller is not None else contextlib.nullcontext()
        with view:
            objects = self._training_objects()
            return self.checkpointer.save(output_dir, objects, async_save=async_save)

    def wait_for_checkpoint(self) -> str | None:
        """Finish and commit a pending asynchronous save (collective); its location."""
        if "_checkpointer" not in self.__dict__:
            return None
        return self.checkpointer.wait()

    def load_state(self, input_dir: str | None = None, **_: Any) -> str | None:
        """Restore what :meth:`save_state` saved (the latest automatic checkpoint when
        ``input_dir`` is omitted); the next batch of each prepared dataloader is the one that
        followed the save. Returns the checkpoint's location.

        ``load_state("latest")`` loads the newest committed checkpoint in
        ``{project_dir}/checkpoints`` and does nothing (returns ``None``) when there is none,
        so one command both starts and resumes a job.
        """
        if input_dir == "latest":
            input_dir = self.checkpointer.latest()
            if input_dir is None:
                return None
        return self.checkpointer.load(input_dir, self._training_objects())

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (anything with ``state_dict``/``load_state_dict``) in
        :meth:`save_state` and :meth:`load_state`, in registration order."""
        invalid = [
            f"Item at index {i} ({type(o).__name__})"
            for i, o in enumerate(objects)
            if not (
                callable(getattr(o, "state_dict", None))
                and callable(getattr(o, "load_state_dict", None))
            )
        ]
        if invalid:  # a ValueError, as Accelerate raises
            raise ValueError(
                "register_for_checkpointing needs objects with state_dict() and "
                f"load_state_dict(); these have not: {', '.join(invalid)}"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: SaveHook) -> _HookHandle:
        """Call ``hook(models, weights, output_dir)`` before saving; removing entries from
        ``models``/``weights`` leaves those models for the hook to save its own way."""
        return _HookHandle(self._save_hooks, hook)

    def register_load_state_pre_hook(self, hook: LoadHook) -> _HookHandle:
        """Call ``hook(models, input_dir)`` before loading; removing entries from ``models``
        leaves those models for the hook to load its own way."""
        return _HookHandle(self._load_hooks, hook)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write the model's full weights as safetensors (sharded with an index when larger
        than ``max_shard_size``; ``dtype=torch.bfloat16`` for 16-bit weights) from the main
        process. Must be called on every process (sharded strategies gather first)."""
        from ..checkpoint.weights import save_weights

        state_dict = self.get_state_dict(model)
        self.checkpointer._on_main(
            lambda: save_weights(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
                dtype=dtype,
            )
        )

    def load_model(self, model: nn.Module, load_directory: str, strict: bool = True) -> None:
        """Load weights written by :meth:`save_model` (or Hugging Face) into ``model``."""
        from ..checkpoint.weights import load_weights

        target = self.unwrap_model(model)
        target.load_state_dict(load_weights(load_directory), strict=strict)

    def save(self, obj: Any, f: str, safe_serialization: bool = False) -> None:
        """Save ``obj`` once, from the main process (``torch.save``, or safetensors for a
        dict of tensors with ``safe_serialization=True``)."""
        from ..checkpoint.serialization import save_object, save_tensors
        from ..checkpoint.storage import Storage

        def write() -> None:
            storage = Storage.for_url(f)
            if safe_serialization:
                save_tensors(storage, storage.root, obj)
            else:
                save_object(storage, storage.root, obj)

        self.checkpointer._on_main(write)
