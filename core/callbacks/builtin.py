"""Built-in callbacks: gradient norm, early stopping across processes (the throughput
monitor has a module of its own: :mod:`slipstream.callbacks.throughput`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Callback


class GradientNormMonitor(Callback):
    """Logs ``grad_norm`` (the global norm over all processes and shards, unscaled under
    fp16) before each optimizer step."""

    def __init__(self, norm_type: float = 2.0, log_every_n_steps: int = 1) -> None:
        self.norm_type = norm_type
        self.log_every_n_steps = log_every_n_steps
        self.last_norm: float | None = None
        self._count = 0

    def on_before_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        self._count += 1
        if self._count % self.log_every_n_steps:
            return
        accelerator.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = accelerator.strategy.clip_grad_norm_(params, math.inf, self.norm_type)
        self.last_norm = float(norm)
        accelerator.log({"grad_norm": self.last_norm}, step=accelerator.step)


class EarlyStopping(Callback):
    """Stops when ``monitor`` (a value passed to ``accelerator.log``) stops improving.

    The value is averaged over processes, so every process decides the same; when it
    stops improving for ``patience`` logs, ``should_stop`` becomes True everywhere and the
    Accelerator's trigger is set (``accelerator.check_trigger()`` is then True).

    Example::

        stopper = EarlyStopping(monitor="val_loss", patience=3)
        accelerator = Accelerator(callbacks=[stopper])
        for epoch in range(100):
            ...
            accelerator.log({"val_loss": val_loss}, step=epoch)   # on every process
            if stopper.should_stop:
                break
    """

    def __init__(
        self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.best: float | None = None
        self.bad_logs = 0
        self.should_stop = False

    def on_log(self, accelerator: Any, values: dict[str, Any], step: int | None) -> None:
        if self.monitor not in values:
            return
        value = torch.as_tensor(
            values[self.monitor], dtype=torch.float64, device=accelerator.device
        )
        current = float(accelerator.reduce(value.detach().clone(), "mean"))
        improved = self.best is None or (
            current < self.best - self.min_delta
            if self.mode == "min"
            else current > self.best + self.min_delta
        )
        if improved:
            self.best, self.bad_logs = current, 0
        else:
            self.bad_logs += 1
        if self.bad_logs >= self.patience and not self.should_stop:
            self.should_stop = True
            accelerator.set_trigger()

    def on_save_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(best=self.best, bad_logs=self.bad_logs, should_stop=self.should_stop)

    def on_load_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        self.best = checkpoint.get("best")
        self.bad_logs = int(checkpoint.get("bad_logs", 0))
        self.should_stop = bool(checkpoint.get("should_stop", False))
