"""The training-step part of the Accelerator: backward, gradient accumulation, autocast and
gradient clipping, routed through the strategy, the precision and the step state."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..callbacks import CallbackRunner
from ..data.active_loaders import ActiveLoaders
from ..optim.optimizer import AcceleratedOptimizer, StepCoordinator
from ..optim.step import StepState
from ..options.kwargs import AutocastKwargs
from ..precision import Precision
from ..runtime.flight import PROGRESS
from ..runtime.state import ProcessState
from ..strategies import Strategy


class TrainingStepMixin:
    """backward / accumulate / no_sync / autocast / clipping for the Accelerator."""

    # Provided by the Accelerator.
    state: ProcessState
    strategy: Strategy
    precision: Precision
    step_state: StepState
    coordinator: StepCoordinator
    callbacks: CallbackRunner
    active_loaders: ActiveLoaders
    _models: list[nn.Module]
    _optimizers: list[AcceleratedOptimizer]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with gradient-accumulation averaging and loss scaling.

        With accumulation the loss is divided by ``gradient_accumulation_steps``, so N
        accumulated micro-batches give the update of one N-times larger batch (a shorter
        final cycle of an epoch is divided by N too, as in Accelerate, unless
        ``GradientAccumulationPlugin(average_short_cycles=True)``).
        """
        if self.coordinator.pending:
            self.coordinator.finish()  # a step left open by optimizers that did not all step
        mesh = self.state.mesh
        if mesh is not None and mesh.submesh("pp") is not None:
            raise RuntimeError(
                "under pipeline parallelism forward and backward run together inside the "
                "pipeline schedule: replace `loss = loss_fn(model(x), y); "
                "accelerator.backward(loss)` with `loss = accelerator.forward_backward(model, "
                "x, target=y, loss_fn=loss_fn)` (it works without pipeline parallelism too)"
            )
        # Runs every step: the hooks are only looked up when there are callbacks.
        hooks = self.callbacks.callbacks
        if hooks:
            self.callbacks.call("on_before_backward", self, loss)
        timed = PROGRESS.time_backward  # (a StragglerMonitor's)
        started = time.perf_counter() if timed else 0.0
        loss = self._scaled_loss(loss)
        if self.strategy.plain_backward:
            loss.backward(**kwargs)
        else:
            self.strategy.backward(loss, **kwargs)
        if timed:  # where data-parallel processes wait for each other
            ended = PROGRESS.backward_end = time.perf_counter()
            PROGRESS.backward_seconds += ended - started
        if hooks:
            self.callbacks.call("on_after_backward", self)

    def _scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as backward needs it: averaged over the accumulation cycle's
        micro-batches and multiplied by the fp16 loss scale."""
        if self.step_state.gradient_accumulation_steps > 1:
            loss = loss / self.step_state.loss_divisor
        if self.precision.scales_loss:
            loss = self.precision.scale_loss(loss)
        return loss

    def forward_backward(
        self,
        model: nn.Module,
        *args: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch; returns the batch's (detached) mean loss.

        The one training-step call that works under every strategy, pipeline parallelism
        included, so one script runs with and without it::

            loss = accelerator.forward_backward(model, x, target=y, loss_fn=F.cross_entropy)
            loss = accelerator.forward_backward(model, **batch)   # transformers: outputs.loss

        Without ``loss_fn`` the model's output must carry the loss (``outputs.loss``, as a
        transformers model computes it from ``labels``). Under pipeline parallelism the
        micro-batches run through the schedule, the last stage computes the loss (for a
        transformers model from ``labels`` with the model's own loss function), and every
        process gets the same value. Accumulation, loss scaling and callbacks apply as with
        :meth:`backward`.
        """
        # Under pipeline parallelism this runs before every step's first forward, on the
        # pipeline's critical path: no exception for a missing attribute, no import.
        positional: tuple[Any, ...] = args
        if (
            len(args) == 1
            and not kwargs
            and type(args[0]) is not torch.Tensor
            and isinstance(args[0], Mapping)
        ):
            positional, kwargs = (), dict(args[0])
        unwrapped = _without_compile_wrapper(model)
        api = _pipeline_package()
        pipeline = api.pipeline_of(unwrapped)
        if pipeline is None:
            outputs = model(*positional, **kwargs)
            loss = loss_fn(outputs, target) if loss_fn is not None else _loss_of(outputs)
            self.backward(loss)
            return loss.detach()
        inputs, labels = api.pipeline_inputs(str(unwrapped._pipeline_kind), positional, kwargs)
        target = labels if target is None else target
        if loss_fn is None:
            loss_fn = api.model_loss(unwrapped)
        if self.coordinator.pending:
            self.coordinator.finish()
        hooks = self.callbacks.callbacks
        if hooks:  # forward and backward interleave: there is no loss before backward yet
            self.callbacks.call("on_before_backward", self, None)
        timed = PROGRESS.time_backward
        started = time.perf_counter() if timed else 0.0
        loss = pipeline.train(inputs, target, loss_fn, self._scaled_loss)
        if timed:  # the schedule's waits are in here
            ended = PROGRESS.backward_end = time.perf_counter()
            PROGRESS.backward_seconds += ended - started
        if hooks:
            self.callbacks.call("on_after_backward", self)
        return loss

    def call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Fire ``hook(accelerator, *args, **kwargs)`` on every callback that defines it
        (for loop-level events such as ``on_validation_epoch_end``)."""
        self.callbacks.call(hook, self, *args, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients synchronise (and optimizers step) only every
        ``gradient_accumulation_steps`` micro-steps and at the end of the dataloader; in
        between, backward runs without inter-process communication."""
        loader = self.active_loaders.innermost
        self.step_state.begin_micro_step(
            self.active_loaders.end_of_dataloader,
            loader.batches_left if loader is not None else None,
        )
        with contextlib.ExitStack() as stack:
            if not (self.step_state.sync_gradients or self.step_state.sync_each_batch):
                for model in models or self._models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Run backward inside without synchronising ``model``'s gradients."""
        with self.strategy.no_sync(getattr(model, "_orig_mod", model)):
            yield

    def model_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """Build models inside this: under DeepSpeed ZeRO-3 with ``zero3_init_flag`` each
        process then holds only its partition (no process ever has the whole model)."""
        context = getattr(self.strategy, "model_init_context", None)
        return context() if context is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def autocast(
        self, autocast_handler: AutocastKwargs | None = None, *, enabled: bool = True
    ) -> Iterator[None]:
        """Run the block under the mixed-precision autocast (no-op at full precision).

        ``autocast_handler`` (Accelerate's argument) overrides the Accelerator's
        ``AutocastKwargs`` for this block: ``enabled=False`` turns autocast off,
        ``cache_enabled`` sets torch's weight-cast cache.

        Example::

            with accelerator.autocast(AutocastKwargs(enabled=False)):
                exact = model.head(features)   # fp32 here, under bf16/fp16 training
        """
        cache_enabled = None
        if autocast_handler is not None:
            enabled = enabled and autocast_handler.enabled
            cache_enabled = autocast_handler.cache_enabled
        with self.precision.autocast(enabled=enabled, cache_enabled=cache_enabled):
            yield

    def unscale_gradients(self, optimizer: AcceleratedOptimizer | None = None) -> None:
        """Divide fp16-scaled gradients by the loss scale (before clipping or inspecting).

        Safe to call more than once per step: each optimizer is unscaled once.
        """
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            opt.unscale_gradients()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients to a total norm of ``max_norm``; returns the total norm before
        clipping (over all processes for sharded strategies; fp16 gradients are unscaled
        first).

        Only synchronising micro-steps clip, since only they step the optimizer; on the
        others the gradients are partial and are left alone (the norm is still returned).
        """
        parameters = list(parameters)
        if not self.step_state.sync_gradients:
            return self._unscaled_norm(parameters, norm_type)
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def _unscaled_norm(self, parameters: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        # Between synchronising steps the gradients are this process's own partial sums:
        # measure the local parts (a DTensor's shard), without communication.
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in parameters if p.grad is not None]
        if not grads:
            return torch.tensor(0.0, device=self.state.device)
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]),
            norm_type,
        )
        scaler = self.precision.scaler
        return norm / scaler.get_scale() if scaler is not None else norm

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (on synchronising
        micro-steps, after unscaling fp16 gradients)."""
        if not self.step_state.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)


def _loss_of(outputs: Any) -> torch.Tensor:
    """The loss a model returned with its outputs (transformers' ``outputs.loss``)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"forward_backward got no loss_fn and the model's output ({type(outputs).__name__}) "
            "carries no loss: pass loss_fn=... (and target=...), or labels to a model that "
            "computes its loss"
        )
    return loss


def _without_compile_wrapper(model: Any) -> Any:
    """``model`` without torch.compile's wrapper, which holds it as its ``_orig_mod``
    submodule (looked up there: a missing attribute of an ``nn.Module`` costs an exception)."""
    modules = getattr(model, "_modules", None)
    return modules.get("_orig_mod", model) if isinstance(modules, dict) else model


@functools.cache
def _pipeline_package() -> Any:
    """slipstream's pipeline package, imported on the first ``forward_backward`` (a
    ``from`` import of a package runs importlib's Python on every call)."""
    from ..parallel import pipeline

    return pipeline
