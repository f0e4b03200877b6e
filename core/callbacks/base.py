"""Callback: the hooks slipstream calls, with their arguments (subclassing is optional).

Any object can be a callback: each hook is called on every callback that defines a method
of that name. The Accelerator fires the hooks it sees itself; ``accelerator.call(name, ...)``
fires any other (loop-level) hook from your script.

Example::

    class PrintLoss(Callback):
        def on_before_backward(self, accelerator, loss):
            accelerator.print(f"loss {loss.item():.4f}")

    accelerator = Accelerator(callbacks=[PrintLoss()])
"""

from __future__ import annotations

from typing import Any


class Callback:
    """Documents every hook; override the ones you need."""

    # -- fired by the Accelerator -------------------------------------------------------------
    def on_before_backward(self, accelerator: Any, loss: Any) -> None:
        """In ``accelerator.backward(loss)``, before the backward pass."""

    def on_after_backward(self, accelerator: Any) -> None:
        """In ``accelerator.backward``, after gradients are computed (and synchronised)."""

    def on_before_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        """Before a prepared optimizer really steps (synchronising micro-steps only)."""

    def on_after_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        """After a prepared optimizer stepped."""

    def on_before_zero_grad(self, accelerator: Any, optimizer: Any) -> None:
        """Before a prepared optimizer zeroes its gradients (synchronising micro-steps)."""

    def on_dataloader_epoch_end(self, accelerator: Any, dataloader: Any) -> None:
        """When a prepared dataloader finished a whole pass."""

    def on_log(self, accelerator: Any, values: dict[str, Any], step: int | None) -> None:
        """In ``accelerator.log`` (on every process that calls it)."""

    def on_save_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        """In ``save_state``: put what this callback must keep into ``checkpoint``."""

    def on_load_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        """In ``load_state``: ``checkpoint`` is what ``on_save_checkpoint`` stored."""

    def on_train_end(self, accelerator: Any) -> None:
        """In ``accelerator.end_training()``."""

    # -- fired from your loop with accelerator.call(...) ------------------------------------
    def on_train_start(self, accelerator: Any) -> None:
        """Call it yourself: ``accelerator.call("on_train_start")``."""

    def on_train_epoch_end(self, accelerator: Any) -> None:
        """Call it yourself at the end of each training epoch."""

    def on_validation_epoch_end(self, accelerator: Any, metrics: dict[str, Any]) -> None:
        """Call it yourself with the epoch's validation metrics."""
