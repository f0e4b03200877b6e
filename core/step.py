"""StepState: which micro-step we are on and whether gradients synchronise on it.

Shared by the Accelerator, the prepared optimizers and the prepared schedulers so they agree
on when an optimizer step really happens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepState:
    """Gradient-accumulation bookkeeping for one Accelerator."""

    gradient_accumulation_steps: int = 1
    #: True on micro-steps whose backward synchronises gradients and whose optimizer steps.
    sync_gradients: bool = True
    #: Micro-steps entered through ``accumulate()``.
    micro_steps: int = 0
    #: Optimizer steps taken (not skipped) — the checkpointed "step".
    optimizer_steps: int = 0

    def __post_init__(self) -> None:
        if int(self.gradient_accumulation_steps) != self.gradient_accumulation_steps or (
            self.gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an integer >= 1, got "
                f"{self.gradient_accumulation_steps!r}"
            )

    def begin_micro_step(self, end_of_dataloader: bool) -> None:
        """Advance one micro-step; the last micro-step of a cycle or an epoch synchronises."""
        self.micro_steps += 1
        self.sync_gradients = (
            self.micro_steps % self.gradient_accumulation_steps == 0 or end_of_dataloader
        )
        if end_of_dataloader:
            # A new epoch starts a new accumulation cycle.
            self.micro_steps = 0
