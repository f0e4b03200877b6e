"""AcceleratedOptimizer: the user's optimizer, stepping only when gradients are in sync.

It is an instance of ``torch.optim.Optimizer`` (schedulers and isinstance checks accept it)
that forwards everything to the wrapped optimizer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..callbacks.runner import CallbackRunner
from ..runtime.flight import PROGRESS
from .step import StepState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; ``step``/``zero_grad`` act only on synchronising micro-steps.

    Example::

        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))
        optimizer.step()                 # skipped between accumulation boundaries
        optimizer.optimizer              # the original optimizer
    """

    def __init__(
        self, optimizer: Any, coordinator: StepCoordinator, *, original: Any = None
    ) -> None:
        # Deliberately no super().__init__: all state lives in the wrapped optimizer.
        self.optimizer = optimizer
        #: What the user passed to prepare() (differs when a strategy rebuilt the optimizer).
        self.original = original if original is not None else optimizer
        self.coordinator = coordinator
        self.step_state = coordinator.step_state
        #: True when the last sync-step was skipped (fp16 overflow).
        self.step_was_skipped = False
        self._unscaled = False
        coordinator.register(self)

    @property
    def scaler(self) -> Any:
        return self.coordinator.scaler

    # -- forwarded state ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    # -- stepping -------------------------------------------------------------------------
    def unscale_gradients(self) -> None:
        """Divide fp16-scaled gradients by the loss scale, once per optimizer step."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        coordinator = self.coordinator
        if self.step_state.sync_gradients and coordinator.engine is None:
            if coordinator.callbacks.callbacks:
                coordinator.notify("on_before_zero_grad", self)
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self.step_state.sync_gradients:
            return None
        return self.coordinator.step(self, closure)

    def train(self) -> None:
        """Forward ``train()`` for schedule-free optimizers that define it."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()


def _nobody() -> None:
    return None


class StepCoordinator:
    """Coordinates the optimizers of one Accelerator within a training step.

    With fp16 the loss scale must be updated once per step, after every optimizer has
    stepped (updating between two optimizers would unscale the second one's gradients
    twice). The update happens as soon as every prepared optimizer has stepped, or — when
    only some step — before the next backward or when one of them steps again.
    """

    def __init__(self, step_state: StepState, scaler: Any = None, engine: Any = None) -> None:
        self.step_state = step_state
        self.scaler = scaler
        #: A strategy whose engine steps the optimizer inside backward (DeepSpeed); the
        #: prepared optimizers' step() then only records the outcome.
        self.engine = engine
        #: The callbacks whose optimizer hooks fire, and the object passed to them first
        #: (both set by the Accelerator; hooks are skipped while there are no callbacks).
        self.callbacks = CallbackRunner()
        self._hook_owner: Callable[[], Any] = _nobody
        self.optimizers: list[AcceleratedOptimizer] = []
        self.pending: list[AcceleratedOptimizer] = []
        #: Set (by a guard's ``on_before_optimizer_step``) to skip the current step: no
        #: optimizer applies its gradients, and the step counts as skipped, as an fp16
        #: overflow does. Reset when the step closes.
        self.skip_step = False
        #: A strategy whose device needs work around each optimizer step (XLA: average
        #: the gradients over the processes before it, the step barrier after it).
        self.device_step: Any = None

    @property
    def hook_owner(self) -> Any:
        """The object passed to callbacks first (the Accelerator), held weakly: it holds
        this coordinator, and a strong reference back would keep it alive until the garbage
        collector runs."""
        return self._hook_owner()

    @hook_owner.setter
    def hook_owner(self, owner: Any) -> None:
        self._hook_owner = _nobody if owner is None else weakref.ref(owner)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_hook_owner"] = self.hook_owner  # pickled as the object itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        owner = state.pop("_hook_owner")
        self.__dict__.update(state)
        self.hook_owner = owner

    def register(self, optimizer: AcceleratedOptimizer) -> None:
        self.optimizers.append(optimizer)

    def notify(self, hook: str, optimizer: AcceleratedOptimizer) -> None:
        """Fire ``hook(owner, optimizer)`` on the callbacks that define it."""
        self.callbacks.call(hook, self.hook_owner, optimizer)

    def step(self, optimizer: AcceleratedOptimizer, closure: Callable[[], float] | None) -> Any:
        # `in` compares by identity here (AcceleratedOptimizer keeps object equality).
        if optimizer in self.pending:
            self.finish()  # it steps again: the previous step is over
        inner = optimizer.optimizer
        if self.callbacks.callbacks:
            self.notify("on_before_optimizer_step", optimizer)
        device_step = self.device_step
        if device_step is not None:
            device_step.before_optimizer_step(inner)
        if self.engine is not None or self.skip_step:
            result = None
        elif self.scaler is not None:
            result = self.scaler.step(inner, closure) if closure else self.scaler.step(inner)
        else:
            result = inner.step(closure) if closure is not None else inner.step()
        if device_step is not None:
            device_step.after_optimizer_step()
        pending = self.pending
        pending.append(optimizer)
        # pending holds each registered optimizer at most once (see above).
        if len(pending) == len(self.optimizers):
            self.finish()
        if self.callbacks.callbacks:
            self.notify("on_after_optimizer_step", optimizer)
        return result

    def finish(self) -> None:
        """Close the current step: update the loss scale, record skipped and counted steps."""
        if not self.pending:
            return
        skipped = self.skip_step
        if self.engine is not None:
            skipped = skipped or self.engine.step_was_skipped()
        elif self.scaler is not None and not skipped:
            before = self.scaler.get_scale()
            self.scaler.update()
            skipped = self.scaler.get_scale() < before
        elif self.scaler is not None and any(o._unscaled for o in self.pending):
            # A guard skipped a step whose gradients were unscaled: close the scaler's step
            # (it has the inf checks it needs) so the next one may unscale again.
            self.scaler.update()
        for optimizer in self.pending:
            optimizer.step_was_skipped = skipped
            optimizer._unscaled = False
        if not skipped:
            self.step_state.optimizer_steps += 1
        PROGRESS.mark_step(self.step_state.optimizer_steps)  # for the hang watchdog
        self.pending = []
        self.skip_step = False
