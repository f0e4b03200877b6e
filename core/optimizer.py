"""AcceleratedOptimizer: the user's optimizer, stepping only when gradients are in sync.

It is an instance of ``torch.optim.Optimizer`` (schedulers and isinstance checks accept it)
that forwards everything to the wrapped optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .step import StepState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; ``step``/``zero_grad`` act only on synchronising micro-steps.

    Example::

        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))
        optimizer.step()                 # skipped between accumulation boundaries
        optimizer.optimizer              # the original optimizer
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        step_state: StepState,
        *,
        scaler: Any = None,
    ) -> None:
        # Deliberately no super().__init__: all state lives in the wrapped optimizer.
        self.optimizer = optimizer
        self.step_state = step_state
        self.scaler = scaler
        #: True when the last sync-step was skipped (fp16 overflow).
        self.step_was_skipped = False
        self._unscaled = False

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
        if self.step_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self.step_state.sync_gradients:
            return None
        self._unscaled = False
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure)
            self.scaler.update()
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self.step_was_skipped = False
        if not self.step_was_skipped:
            self.step_state.optimizer_steps += 1
        return result

    def train(self) -> None:
        """Forward ``train()`` for schedule-free optimizers that define it."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()
