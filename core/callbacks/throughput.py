"""ThroughputMonitor: samples/s, tokens/s, model FLOPs per step and model FLOPs utilisation
(MFU), logged through the trackers every ``log_every_n_steps`` optimizer steps.

* samples per step: the active prepared dataloader's global batch times the accumulation
  steps (or ``samples_per_step``);
* tokens: counted when the model is called with token ids (``input_ids=...``, or an
  integer tensor as first argument), on every process, times the data-parallel processes;
* model FLOPs per step (``flops_per_step``, or found once): for transformers models
  ``6 N + 12 L H d T`` per token (:func:`slipstream.diagnostics.flops.
  transformer_flops_per_token`); for any other model one real step is counted with torch's
  ``FlopCounterMode`` (that step only runs slower);
* MFU: model FLOPs per second over the peak of all devices, from the table of known
  accelerators (:data:`slipstream.diagnostics.flops.PEAKS`), ``peak_flops=`` (per device),
  or ``peak_flops="measure"`` (a matmul benchmark, e.g. for CPUs). Without a peak (CPUs)
  the achieved FLOP/s per device is logged alone.

Logged at the optimizer steps that are multiples of ``log_every_n_steps`` (as
:class:`~slipstream.callbacks.stragglers.StragglerMonitor` logs: their rows meet):
``throughput/step_seconds``, ``throughput/samples_per_second``,
``throughput/tokens_per_second``, ``throughput/flops_per_step`` (the whole job's),
``throughput/flops_per_second`` (per device) and ``throughput/mfu``. The same figures of the
last window are in ``monitor.last_values`` (a dict, on every process). Without a tracker
(``Accelerator(log_with=...)``) the monitor says so once and prints one short line per
window instead (:func:`~slipstream.callbacks.notes.say`).

Example::

    monitor = ThroughputMonitor(log_every_n_steps=20)
    accelerator = Accelerator(mixed_precision="bf16", callbacks=[monitor], log_with="wandb")
    ...
    monitor.last_values["throughput/mfu"]     # e.g. 0.41 on H100s
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..diagnostics.flops import (
    StepFlopCounter,
    measure_peak_flops,
    peak_flops,
    transformer_flops_per_token,
)
from .base import Callback
from .notes import say


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """``(tokens, sequence length)`` of a model call with token ids, else ``None``."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.ndim < 1:
        return None
    return ids.numel(), int(ids.shape[-1])


class ThroughputMonitor(Callback):
    """See the module docstring.

    Args:
        log_every_n_steps: optimizer steps per logged window.
        samples_per_step: global samples per optimizer step (default: from the loader).
        flops_per_step: the whole job's model FLOPs per optimizer step (default: found).
        peak_flops: peak FLOP/s of one device, or ``"measure"`` (default: the table).
        count_flops: find the model FLOPs (``False``: samples and tokens only).
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        samples_per_step: int | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | str | None = None,
        count_flops: bool = True,
    ) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.samples_per_step = samples_per_step
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.count_flops = count_flops
        self.last_values: dict[str, float] = {}
        self._last: float | None = None
        self._steps = 0
        self._tokens = 0  # this process's, since the window started
        self._step_tokens = 0
        self._sequence = 0
        self._counting: list[Any] = []
        self._counter: StepFlopCounter | None = None
        self._counted = False
        self._restart = False
        self._told = False  # said that there is no tracker

    # -- per call and per step -----------------------------------------------------------
    def _forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found = _tokens(args, kwargs)
        if found is not None:
            self._step_tokens += found[0]
            self._sequence = found[1]

    def on_after_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        if accelerator.coordinator.pending:
            return
        counter = self._counter
        if counter is not None and counter.active:
            # What this process computed, times the processes (each holds its share). The
            # optimizer's own update adds nothing: FlopCounterMode counts matmuls only.
            self.flops_per_step = float(counter.stop() * accelerator.num_processes)
            self._counter, self._counted = None, True
            self._restart = True  # the counted step ran slower: not part of a window
        now = time.perf_counter()
        tokens, self._step_tokens = self._step_tokens, 0
        if self._last is None or self._restart:
            if self._last is None:
                self._attach(accelerator)
            self._last, self._steps, self._tokens, self._restart = now, 0, 0, False
            return
        self._tokens += tokens
        self._steps += 1
        # At the multiples of the window (a first, shorter one joins the next).
        every = self.log_every_n_steps
        if accelerator.step % every == 0 and self._steps >= every:
            self._log(accelerator, now)

    def _attach(self, accelerator: Any) -> None:
        """Watch the prepared models' calls where needed: token ids (transformers models,
        every call) and the step whose FLOPs are counted (once)."""
        if not accelerator._models:
            return
        model = accelerator.unwrap_model(accelerator._models[0])
        formula = transformer_flops_per_token(model, 1) is not None
        if getattr(model, "config", None) is not None:
            for wrapped in accelerator._models:
                wrapped.register_forward_pre_hook(self._forward, with_kwargs=True)
        if self.flops_per_step is None and self.count_flops and not formula:
            self._counter = StepFlopCounter()  # counts the next step
            self._counting = [
                wrapped.register_forward_pre_hook(self._start_counting)
                for wrapped in accelerator._models
            ]

    def _start_counting(self, module: Any, args: Any) -> None:
        if self._counter is not None and not self._counter.active:
            self._counter.start()
        for handle in self._counting:  # once is enough: no cost on later calls
            handle.remove()
        self._counting = []

    # -- the window ----------------------------------------------------------------------
    def _log(self, accelerator: Any, now: float) -> None:
        assert self._last is not None
        seconds = (now - self._last) / self._steps
        values: dict[str, float] = {"throughput/step_seconds": seconds}
        samples = self.samples_per_step
        if samples is None:
            loader = accelerator.active_loaders.innermost
            batch = loader.total_batch_size if loader is not None else None
            samples = batch * accelerator.gradient_accumulation_steps if batch else None
        if samples:
            values["throughput/samples_per_second"] = samples / seconds
        if self._tokens:
            tokens = self._tokens / self._steps * accelerator.state.data_parallel_size
            values["throughput/tokens_per_second"] = tokens / seconds
            if self.flops_per_step is None and self.count_flops and accelerator._models:
                model = accelerator.unwrap_model(accelerator._models[0])
                per_token = transformer_flops_per_token(model, self._sequence)
                if per_token is not None:
                    values["throughput/flops_per_step"] = float(per_token * tokens)
        flops = values.get("throughput/flops_per_step", self.flops_per_step)
        if flops:
            values["throughput/flops_per_step"] = float(flops)
            per_device = flops / seconds / accelerator.num_processes
            values["throughput/flops_per_second"] = per_device
            peak = self._peak(accelerator)
            if peak:
                values["throughput/mfu"] = per_device / peak
        self.last_values = values
        accelerator.log(values, step=accelerator.step)
        if not accelerator.trackers:
            self._print(accelerator, values)
        self._last, self._steps, self._tokens = now, 0, 0

    def _print(self, accelerator: Any, values: dict[str, float]) -> None:
        """No tracker to log to: one short line per window (the first says why)."""
        if not self._told:
            self._told = True
            say(
                accelerator,
                "ThroughputMonitor: no tracker to log to (Accelerator(log_with=...)); "
                f"printing its figures every {self.log_every_n_steps} steps (also in "
                "monitor.last_values)",
            )
        parts = [f"{values['throughput/step_seconds']:.4f} s/step"]
        for key, unit in (("samples_per_second", "samples/s"), ("tokens_per_second", "tokens/s")):
            if f"throughput/{key}" in values:
                parts.append(f"{values[f'throughput/{key}']:.1f} {unit}")
        if "throughput/flops_per_second" in values:
            parts.append(f"{values['throughput/flops_per_second']:.3g} FLOP/s per device")
        if "throughput/mfu" in values:
            parts.append(f"MFU {values['throughput/mfu']:.1%}")
        say(accelerator, f"throughput at step {accelerator.step}: {', '.join(parts)}")

    def _peak(self, accelerator: Any) -> float | None:
        if self.peak_flops == "measure":
            self.peak_flops = measure_peak_flops(accelerator.device)
        if isinstance(self.peak_flops, (int, float)):
            return float(self.peak_flops)
        return peak_flops(accelerator.device, accelerator.mixed_precision)
