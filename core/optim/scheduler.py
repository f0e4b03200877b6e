"""AcceleratedScheduler: steps the user's LR scheduler only when the optimizer stepped.

The rule (the same as Accelerate's, so schedules carry over unchanged): a scheduler written
for the single-process number of steps advances ``num_processes`` times per optimizer step,
because each step consumes ``num_processes`` batches of the script's size; with
``split_batches`` (the global batch keeps the script's size) it advances once. It does not
advance on accumulation micro-steps nor on steps skipped for fp16 overflow.
"""

from __future__ import annotations

from typing import Any

from .optimizer import AcceleratedOptimizer
from .step import StepState


class AcceleratedScheduler:
    """Wraps an LR scheduler; see the module docstring for when it steps.

    Example::

        scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, 10))
        scheduler.step()
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        step_state: StepState,
        *,
        steps_per_optimizer_step: int = 1,
        step_with_optimizer: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.step_state = step_state
        self.steps_per_optimizer_step = steps_per_optimizer_step
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.step_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        total_steps = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.steps_per_optimizer_step):
            # OneCycleLR raises past its total_steps; stop there instead of failing late.
            if total_steps is not None and self.scheduler.last_epoch >= total_steps:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set in __init__ (e.g. last_epoch, base_lrs).
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
