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
    #: Micro-steps entered through ``accumulate()`` in the current epoch.
    micro_steps: int = 0
    #: Micro-batches in the current accumulation cycle (shorter at the end of an epoch
    #: whose length is not a multiple of ``gradient_accumulation_steps``).
    cycle_length: int = 1
    #: Optimizer steps taken (not skipped) — the checkpointed "step".
    optimizer_steps: int = 0
    #: The end of a dataloader ends the accumulation cycle (else cycles span epochs).
    sync_with_dataloader: bool = True
    #: Synchronise gradients on every micro-step (they still accumulate until the step).
    sync_each_batch: bool = False
    #: Divide the losses of an epoch's short final cycle by the micro-batches it really has
    #: (its update is that of one batch of their size) instead of by
    #: ``gradient_accumulation_steps`` (Accelerate's and Lightning's arithmetic, the default).
    average_short_cycles: bool = False

    def __post_init__(self) -> None:
        self.set_accumulation(self.gradient_accumulation_steps)

    def set_accumulation(self, steps: int) -> None:
        """Accumulate over ``steps`` micro-batches from the next cycle on."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}")
        self.gradient_accumulation_steps = self.cycle_length = steps

    def begin_micro_step(self, end_of_dataloader: bool, batches_left: int | None = None) -> None:
        """Advance one micro-step.

        The last micro-step of a cycle, and the last batch of an epoch, synchronise.
        ``batches_left`` (this one included), when the dataloader knows it, gives the length
        of the final cycle of an epoch (see ``average_short_cycles``).
        """
        steps = self.gradient_accumulation_steps
        if not self.sync_with_dataloader:
            end_of_dataloader, batches_left = False, None
        position = self.micro_steps % steps
        if position == 0:
            self.cycle_length = steps if batches_left is None else max(1, min(steps, batches_left))
        self.micro_steps += 1
        self.sync_gradients = position + 1 == self.cycle_length or end_of_dataloader
        if end_of_dataloader:
            self.micro_steps = 0  # a new epoch starts a new cycle

    @property
    def loss_divisor(self) -> int:
        """What ``backward`` divides the loss by: ``gradient_accumulation_steps``, or with
        ``average_short_cycles`` the micro-batches of this cycle."""
        return self.cycle_length if self.average_short_cycles else self.gradient_accumulation_steps
