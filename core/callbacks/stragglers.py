"""StragglerMonitor: which process slows the job down, found without slowing it down.

In synchronous data-parallel training every process ends each step at the same moment (the
gradient exchange waits for the slowest), so step times alone cannot name a straggler. What
differs is the time a process spends *outside* the backward pass, where the exchange
waits: fetching data and its forward pass, the optimizer, the script's own code. Each
process measures per step, from clock reads taken only while a monitor exists (the backward
pass is timed by ``accelerator.backward`` from the monitor's creation on, each batch of a
prepared dataloader as it is handed over):

* ``step``: from one optimizer step to the next;
* ``data``: waiting for batches (from the end of the previous step or backward pass to the
  moment a prepared dataloader hands the batch over);
* ``local``: the step minus the backward pass (where the others wait for the slowest).

Every ``log_every_n_steps`` optimizer steps (at the steps that are multiples of it, as
:class:`~slipstream.callbacks.throughput.ThroughputMonitor` logs, so their rows meet) the
processes exchange their averages over the window (one all-gather of three numbers; none on
the other steps). A process whose ``local`` time exceeds ``factor`` times the median of the
others' (by at least ``min_seconds``) is a straggler. One short line (through
:func:`~slipstream.callbacks.notes.say`: the ``slipstream.monitors`` logger, else stdout)
says when the stragglers change — a process becomes one, or none is left — not every
window; the figures of every window go to the trackers:
``straggler/step_seconds``, ``straggler/data_seconds``, ``straggler/local_seconds_median``,
``straggler/local_seconds_max``, ``straggler/slowest_process`` and ``straggler/slowdown``.

Example::

    monitor = StragglerMonitor(log_every_n_steps=50, factor=1.5)
    accelerator = Accelerator(callbacks=[monitor], log_with="tensorboard", project_dir="runs")
    ...
    monitor.stragglers      # the processes named in the last window, e.g. [3]
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

import torch

from ..runtime.collectives import gather, gather_object
from ..runtime.flight import PROGRESS
from .base import Callback
from .notes import say


class StragglerMonitor(Callback):
    """See the module docstring.

    Args:
        log_every_n_steps: optimizer steps per window (and per exchange).
        factor: how many times the others' median ``local`` time makes a straggler.
        min_seconds: the least excess over that median worth a warning (clock noise).
    """

    def __init__(
        self, log_every_n_steps: int = 50, factor: float = 1.5, min_seconds: float = 0.002
    ) -> None:
        if log_every_n_steps < 1 or factor <= 1:
            raise ValueError("StragglerMonitor needs log_every_n_steps >= 1 and factor > 1")
        self.log_every_n_steps = log_every_n_steps
        self.factor = factor
        self.min_seconds = min_seconds
        #: The processes named in the last window, and every process's
        #: ``(step, data, local)`` seconds per step in it (index = process).
        self.stragglers: list[int] = []
        self.last_table: list[tuple[float, float, float]] = []
        self._last_end: float | None = None
        PROGRESS.time_backward = True  # accelerator.backward times itself from now on
        self._backward_mark = PROGRESS.backward_seconds
        self._data = 0.0
        self._sums = [0.0, 0.0, 0.0]
        self._steps = 0
        self._watched: list[Any] = []
        self._hosts: list[str] | None = None

    # -- measuring: one hook per step, and a clock read per batch ---------------------------
    def _batch_ready(self) -> None:
        now = time.perf_counter()
        since = max(self._last_end or now, PROGRESS.backward_end)
        if now > since:
            self._data += now - since

    def on_after_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        if accelerator.coordinator.pending:  # other optimizers of this step still to come
            return
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        backward = PROGRESS.backward_seconds
        in_backward, self._backward_mark = backward - self._backward_mark, backward
        data, self._data = self._data, 0.0
        if last is None:
            self._watch_loaders(accelerator)  # the first step only starts the clock
            return
        step = now - last
        sums = self._sums
        sums[0] += step
        sums[1] += data
        sums[2] += step - in_backward
        self._steps += 1
        # At the multiples of the window (a first, shorter one joins the next).
        every = self.log_every_n_steps
        if accelerator.step % every == 0 and self._steps >= every:
            self._report(accelerator)

    def _watch_loaders(self, accelerator: Any) -> None:
        """Time each batch a prepared dataloader hands over. (Its per-batch ``_place`` —
        device placement — is shadowed on the instance: one more call per batch; a loader
        without it simply reports no data time.)"""
        for loader in accelerator._dataloaders:
            place = getattr(loader, "_place", None)
            if place is None or any(watched is loader for watched in self._watched):
                continue

            def timed(batch: Any, place: Any = place) -> Any:
                placed = place(batch)
                self._batch_ready()
                return placed

            loader.__dict__["_place"] = timed  # (DataLoader's __setattr__ is slow Python)
            self._watched.append(loader)

    # -- the exchange, once per window -----------------------------------------------------
    def _report(self, accelerator: Any) -> None:
        state = accelerator.state
        means = torch.tensor([value / self._steps for value in self._sums], dtype=torch.float64).to(
            state.device
        )
        self._sums, self._steps = [0.0, 0.0, 0.0], 0
        rows = gather(means.unsqueeze(0), state=state).tolist()
        self.last_table = [(float(a), float(b), float(c)) for a, b, c in rows]
        local = [row[2] for row in self.last_table]
        before, self.stragglers = self.stragglers, []
        slowdowns: list[float] = []
        for rank, value in enumerate(local):
            others = local[:rank] + local[rank + 1 :]
            median = statistics.median(others) if others else value
            slowdowns.append(value / median if median > 0 else 1.0)
            if others and value > self.factor * median and value - median > self.min_seconds:
                self.stragglers.append(rank)
        if self._hosts is None and state.num_processes > 1:
            self._hosts = [str(h) for h in gather_object(socket.gethostname(), state=state)]
        slowest = max(range(len(local)), key=local.__getitem__)
        accelerator.log(
            {
                "straggler/step_seconds": statistics.median(r[0] for r in self.last_table),
                "straggler/data_seconds": statistics.median(r[1] for r in self.last_table),
                "straggler/local_seconds_median": statistics.median(local),
                "straggler/local_seconds_max": local[slowest],
                "straggler/slowest_process": slowest,
                "straggler/slowdown": slowdowns[slowest],
            },
            step=accelerator.step,
        )
        if self.stragglers != before:
            say(accelerator, self._describe(before, slowdowns, local), logging.WARNING)

    def _describe(self, before: list[int], slowdowns: list[float], local: list[float]) -> str:
        """One line on the stragglers of the last window (when they changed)."""
        if not self.stragglers:
            return f"stragglers: none any more (was process(es) {before})"
        parts = []
        for rank in self.stragglers:
            _, data, own = self.last_table[rank]
            host = f" ({self._hosts[rank]})" if self._hosts else ""
            median = statistics.median(local[:rank] + local[rank + 1 :])
            parts.append(
                f"process {rank}{host} {slowdowns[rank]:.1f}x: {own:.4f} s per step outside "
                f"backward vs {median:.4f} s (data {data:.4f} s)"
            )
        return f"straggler: {'; '.join(parts)}"
