"""Accelerate's shared-state classes, for scripts that reach for them: ``AcceleratorState``
and ``GradientState``.

Accelerate keeps one hidden state per process that every ``Accelerator`` shares. slipstream
has no such singleton — each Accelerator owns its settings, and the processes share one
:class:`~slipstream.runtime.state.ProcessState` — so these classes are views: of the process
state and of the most recently created Accelerator (the one an Accelerate script has just
made). ``_reset_state()`` starts over as Accelerate's does: Accelerators made before it
refuse to prepare more objects.

Example::

    from slipstream import AcceleratorState
    state = AcceleratorState()               # after Accelerator(...)
    state.distributed_type, state.mixed_precision, state.num_processes
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from ..runtime.partial_state import PartialState, SharedStateView
from ..runtime.state import (
    current_state,
    has_current_state,
    reset_shared_state,
    shared_state_generation,
)

if TYPE_CHECKING:
    import torch

    from ..data.active_loaders import ActiveLoaders
    from ..optim.step import StepState
    from ..options.kwargs import GradientAccumulationPlugin
    from ..runtime.state import ProcessState


class Accelerator(Protocol):
    """What these views read of an Accelerator (the class imports this module)."""

    state: ProcessState
    state_generation: int
    mixed_precision: str
    step_state: StepState
    active_loaders: ActiveLoaders

    @property
    def num_processes(self) -> int: ...

    @property
    def process_index(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


_latest: weakref.ref[Accelerator] | None = None


def note_accelerator(accelerator: Accelerator) -> None:
    """Remember ``accelerator`` as the one ``AcceleratorState()``/``GradientState()`` read."""
    global _latest
    _latest = weakref.ref(accelerator)


def latest_accelerator() -> Accelerator | None:
    """The most recent Accelerator of this process, unless the state was reset since."""
    accelerator = _latest() if _latest is not None else None
    if accelerator is None or accelerator.state_generation != shared_state_generation():
        return None
    return accelerator


def _accelerator_settings() -> Mapping[str, Any]:
    accelerator = latest_accelerator()
    if accelerator is None or not has_current_state():
        return {}
    return {
        "distributed_type": accelerator.state.distributed_type,
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "device": accelerator.device,
    }


def refuse_if_reset(generation: int) -> None:
    """Raise Accelerate's error when an Accelerator made before ``_reset_state()`` is used
    again (mixing its settings into the new run would go unnoticed otherwise)."""
    if generation != shared_state_generation():
        raise AttributeError(
            "`AcceleratorState` object has no attribute `distributed_type`: this Accelerator "
            "belongs to a state that was reset. This happens if "
            "`AcceleratorState._reset_state()` was called and an `Accelerator` or "
            "`PartialState` was not reinitialized: create a new Accelerator"
        )


class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: the process state plus the settings of the
    Accelerator in use (``mixed_precision``, ``distributed_type``). The arguments are
    accepted for Accelerate scripts; an Accelerator's own arguments decide its settings.

    Example::

        accelerator = Accelerator(mixed_precision="bf16")
        AcceleratorState().mixed_precision       # "bf16"
    """

    _shared_state: Mapping[str, Any] = SharedStateView(_accelerator_settings)

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        *args: Any,
        backend: str | None = None,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(cpu, backend=backend, timeout=timeout)
        self._mixed_precision = mixed_precision

    @property
    def mixed_precision(self) -> str:
        accelerator = latest_accelerator()
        if accelerator is not None:
            return accelerator.mixed_precision
        return self._mixed_precision or "no"

    @property
    def use_fp16(self) -> bool:
        return self.mixed_precision != "no"

    @property
    def fsdp_plugin(self) -> Any:
        """The FSDP2 options of the Accelerator in use (``None`` unless sharding with FSDP2)."""
        return current_state().fsdp_plugin if has_current_state() else None

    @property
    def deepspeed_plugin(self) -> Any:
        """The DeepSpeed options of the Accelerator in use (``None`` unless DeepSpeed)."""
        return current_state().deepspeed_plugin if has_current_state() else None

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Start over: Accelerators made before refuse to prepare more objects; with
        ``reset_partial_state`` the process state is rebuilt by the next Accelerator too."""
        reset_shared_state(reset_partial_state)

    def __repr__(self) -> str:
        return (
            f"AcceleratorState(distributed_type={self.distributed_type.value}, num_processes="
            f"{self.num_processes}, process_index={self.process_index}, local_process_index="
            f"{self.local_process_index}, device={self.device}, mixed_precision="
            f"{self.mixed_precision})"
        )


class GradientState:
    """Accelerate's ``GradientState``: where gradient accumulation and the dataloaders
    stand, read from an Accelerator (``accelerator.gradient_state``; ``GradientState()``
    reads the most recent one).

    Example::

        for batch in loader:
            with accelerator.accumulate(model):
                ...
            if accelerator.gradient_state.end_of_dataloader:
                evaluate()
    """

    def __init__(
        self,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        *,
        accelerator: Accelerator | None = None,
    ) -> None:
        self._accelerator = accelerator
        self._plugin = gradient_accumulation_plugin

    def _source(self) -> Accelerator | None:
        return self._accelerator if self._accelerator is not None else latest_accelerator()

    @property
    def initialized(self) -> bool:
        return self._source() is not None

    @property
    def sync_gradients(self) -> bool:
        accelerator = self._source()
        return True if accelerator is None else accelerator.step_state.sync_gradients

    @property
    def num_steps(self) -> int:
        accelerator = self._source()
        if accelerator is None:
            steps = self._plugin.num_steps if self._plugin is not None else None
            return steps or 1
        return accelerator.step_state.gradient_accumulation_steps

    @property
    def sync_with_dataloader(self) -> bool:
        accelerator = self._source()
        return True if accelerator is None else accelerator.step_state.sync_with_dataloader

    @property
    def adjust_scheduler(self) -> bool:
        return self._plugin.adjust_scheduler if self._plugin is not None else True

    @property
    def sync_each_batch(self) -> bool:
        accelerator = self._source()
        if accelerator is None:
            return bool(self._plugin.sync_each_batch) if self._plugin is not None else False
        return accelerator.step_state.sync_each_batch

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The accumulation settings as Accelerate's plugin holds them (the Trainer reads
        ``sync_each_batch`` here)."""
        return {
            "num_steps": self.num_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Say whether the coming micro-step synchronises gradients and steps the optimizer,
        for loops that accumulate by themselves instead of with ``accumulate()`` (as
        ``transformers.Trainer`` does)."""
        accelerator = self._source()
        if accelerator is None:
            raise RuntimeError("_set_sync_gradients needs an Accelerator: create one first")
        accelerator.step_state.sync_gradients = bool(sync_gradients)

    @property
    def active_dataloader(self) -> Any:
        """The prepared dataloader being iterated (the innermost one), or ``None``."""
        accelerator = self._source()
        return None if accelerator is None else accelerator.active_loaders.innermost

    @property
    def dataloader_references(self) -> list[Any]:
        accelerator = self._source()
        return [None] + (list(accelerator.active_loaders.stack) if accelerator else [])

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return loader is not None and bool(loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Samples the final batch repeated to even out processes (-1 outside a loader)."""
        loader = self.active_dataloader
        return -1 if loader is None else int(getattr(loader, "remainder", 0))

    @staticmethod
    def _reset_state() -> None:
        """Accepted for Accelerate scripts: every Accelerator has its own accumulation
        state, so a new Accelerator starts afresh without it."""

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )
