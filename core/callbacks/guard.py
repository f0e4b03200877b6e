"""BadStepGuard: skip optimizer steps whose loss or gradients are not finite, and roll back to
the last checkpoint when bad steps pile up or the loss spikes.

Every process reaches the same decision: each adds its own verdict (non-finite gradients of
its parameters or shards, its loss) into one small all-reduce per optimizer step, so a NaN on
one process skips the step everywhere. A skipped step is counted as an fp16 overflow is
(``accelerator.optimizer_step_was_skipped``, the step number does not advance, schedulers
do not step). After ``max_bad_steps`` bad steps within ``window`` steps, or a loss above
``spike_factor`` times the median of the recent good ones, every process reloads the newest
committed checkpoint (``load_state("latest")``: model, optimizer, scheduler, RNG and data
position) and goes on without the batches of the bad steps.

A rollback that makes no progress (the bad steps come back by the same step whatever batches
are left out: a divergence the data does not cause) is not tried forever: after
``max_rollbacks_without_progress`` of them every process stops with :class:`BadStepError`,
naming the step, the rollbacks done and what to change, instead of leaving out batch after
batch until the data runs out and the run "ends" short of its work.

Resuming at the checkpoint's data position needs the pass over the data to start again:
iterate through the guard, ``for batch in guard.iterate(loader)``, which does that and leaves
out the offending batches. (Without it the rollback restores the training state and training
continues from the current batch.)

Cost when on: a norm of each gradient per optimizer step and, unless the gradients are
replicated and already averaged (DDP) with no spike check, one all-reduce of three numbers. Under DeepSpeed the engine applies its step inside ``backward``, before the guard
decides: there a bad step is not skipped but rolled back.

Example::

    guard = BadStepGuard(max_bad_steps=3, window=50, spike_factor=10.0)
    accelerator = Accelerator(project_dir="runs/a", callbacks=[guard],
                              project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    ...
    for batch in guard.iterate(loader):
        loss = loss_fn(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(guard.skipped_steps, guard.rollbacks)
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .base import Callback
from .notes import say
from .runner import CallbackError

#: Good losses the spike check needs before it judges.
MIN_HISTORY = 3


class BadStepError(CallbackError):
    """BadStepGuard stopped the run: rolling back did not get training past a bad step.
    Raised on every process alike (the decision is the same everywhere)."""


class BadStepGuard(Callback):
    """See the module docstring.

    Args:
        max_bad_steps: bad steps within ``window`` optimizer steps that trigger a rollback
            (``None``: never roll back for them, only skip).
        window: steps over which bad steps are counted and the loss median is taken.
        spike_factor: a loss above this times the median of the last ``window`` good losses
            is a spike: rolled back at once (``None``: no spike check).
        check_gradients: also look for non-finite gradients (the loss alone otherwise).
        max_rollbacks_without_progress: rollbacks in a row that did not get training past
            the step where the previous one was called for; one more stops the run with
            :class:`BadStepError` (``None``: never stop). A rollback called for with no
            checkpoint to go back to counts as one.
    """

    def __init__(
        self,
        max_bad_steps: int | None = 3,
        window: int = 100,
        spike_factor: float | None = None,
        check_gradients: bool = True,
        max_rollbacks_without_progress: int | None = 3,
    ) -> None:
        if window < 1 or (max_bad_steps is not None and max_bad_steps < 1):
            raise ValueError("BadStepGuard needs window >= 1 and max_bad_steps >= 1 (or None)")
        if max_rollbacks_without_progress is not None and max_rollbacks_without_progress < 1:
            raise ValueError(
                "BadStepGuard(max_rollbacks_without_progress=...) must be 1 or more (or None "
                f"to never stop), got {max_rollbacks_without_progress}"
            )
        if spike_factor is not None and spike_factor <= 1:
            raise ValueError(f"spike_factor must be above 1, got {spike_factor}")
        self.max_bad_steps = max_bad_steps
        self.window = window
        self.spike_factor = spike_factor
        self.check_gradients = check_gradients
        self.max_rollbacks_without_progress = max_rollbacks_without_progress
        #: Steps skipped (non-finite or spiking), and rollbacks done, over the whole run.
        self.skipped_steps = 0
        self.rollbacks = 0
        #: The global mean loss of the last step (``None`` before the first).
        self.last_loss: float | None = None
        #: True from a rollback until :meth:`iterate` has restarted the pass.
        self.rolled_back = False
        self._attempt = 0  # optimizer-step attempts, skipped ones included
        self._bad: deque[int] = deque()  # attempts that were bad, within the window
        self._losses: deque[float] = deque(maxlen=window)
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._rollback_due = False
        self._cycle: list[tuple[int, int]] = []  # data positions of the current step
        #: Data positions ``(epoch, batch)`` of the batches of bad steps: left out.
        self.offending: set[tuple[int, int]] = set()
        #: The optimizer step at which the last rollback was called for, and how many
        #: rollbacks in a row have not got training past it.
        self._rollback_step: int | None = None
        self._stuck_rollbacks = 0
        self._no_checkpoint = False

    # -- hooks ---------------------------------------------------------------------------
    def on_before_backward(self, accelerator: Any, loss: Any) -> None:
        if loss is None:  # pipeline parallelism: the loss exists after the schedule only
            return
        if self._gradients_suffice(accelerator):
            return
        value = loss.detach().float().sum()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def on_before_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        coordinator = accelerator.coordinator
        if coordinator.pending:  # another optimizer of this step already decided
            return
        self._attempt += 1
        bad, spike, loss = self._verdict(accelerator)
        self.last_loss = loss
        if not (bad or spike):
            if loss is not None:
                self._losses.append(loss)
            self._cycle = []
            return
        coordinator.skip_step = True
        self.skipped_steps += 1
        self.offending.update(self._cycle)
        self._cycle = []
        self._bad.append(self._attempt)
        while self._bad and self._bad[0] <= self._attempt - self.window:
            self._bad.popleft()
        too_many = self.max_bad_steps is not None and len(self._bad) >= self.max_bad_steps
        self._rollback_due = spike or too_many or coordinator.engine is not None

    def on_after_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        if self._rollback_due and not accelerator.coordinator.pending:
            self._rollback_due = False
            self._rollback(accelerator)

    def on_save_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(attempt=self._attempt, losses=list(self._losses))

    def on_load_checkpoint(self, accelerator: Any, checkpoint: dict[str, Any]) -> None:
        # What the run learned about bad batches (offending, counts) survives a rollback.
        self._attempt = int(checkpoint.get("attempt", 0))
        self._losses = deque(checkpoint.get("losses", []), maxlen=self.window)
        self._bad.clear()

    # -- deciding ------------------------------------------------------------------------
    def _gradients_suffice(self, accelerator: Any) -> bool:
        """Whether the gradients alone decide (see :meth:`_verdict`)."""
        return (
            self.check_gradients
            and self.spike_factor is None
            and accelerator.precision.scaler is None
            and getattr(accelerator.strategy, "name", None) in ("ddp", "single")
        )

    def _verdict(self, accelerator: Any) -> tuple[bool, bool, float | None]:
        """``(non-finite, spike, global mean loss)``, the same on every process."""
        device = accelerator.state.device
        state = accelerator.state
        grads_decide = self.check_gradients and accelerator.precision.scaler is None
        if self._gradients_suffice(accelerator):
            # Replicated gradients, already averaged over the processes: a NaN or inf on one
            # process is in everyone's, so the gradients alone decide alike everywhere with
            # no exchange. (A non-finite loss makes non-finite gradients; one that does not
            # cannot harm the weights.)
            self._loss_sum, self._loss_count = None, 0
            return _non_finite_gradients(accelerator) > 0, False, None
        flags = torch.zeros(3, dtype=torch.float64, device=device)
        if grads_decide:
            # (Under fp16 the loss scaler skips non-finite gradients itself.)
            flags[0] = _non_finite_gradients(accelerator)
        if self._loss_sum is not None:
            flags[1] = self._loss_sum.to(device=device, dtype=torch.float64)
            flags[2] = self._loss_count
        self._loss_sum, self._loss_count = None, 0
        if state.num_processes > 1:
            # The whole job (TP and PP peers too): every process must decide alike.
            dist.all_reduce(flags, group=state.group)
        non_finite, total, count = flags.tolist()
        loss = total / count if count else None
        bad = non_finite > 0 or (loss is not None and not math.isfinite(loss))
        spike = (
            not bad
            and loss is not None
            and self.spike_factor is not None
            and len(self._losses) >= MIN_HISTORY
            and loss > self.spike_factor * abs(statistics.median(self._losses))
        )
        return bad, spike, loss

    def _rollback(self, accelerator: Any) -> None:
        step = int(accelerator.step)
        if self._rollback_step is None or step > self._rollback_step:
            self._stuck_rollbacks = 0  # training got past the last one: it helped
        self._rollback_step = step
        limit = self.max_rollbacks_without_progress
        if limit is not None and self._stuck_rollbacks >= limit:
            raise BadStepError(self._stop_message(step, limit))
        self._stuck_rollbacks += 1
        accelerator.wait_for_checkpoint()
        where = accelerator.load_state("latest")
        self._no_checkpoint = where is None
        if where is None:
            warnings.warn(
                "BadStepGuard: the bad steps call for a rollback, but there is no committed "
                "checkpoint (save_state with automatic checkpoint naming): the steps are only "
                "skipped",
                stacklevel=2,
            )
            return
        self.rollbacks += 1
        self.rolled_back = True
        say(
            accelerator,
            f"BadStepGuard rolled back to {where} (rollback {self.rollbacks}); "
            f"{len(self.offending)} offending batch(es) will be left out",
            logging.WARNING,
        )

    def _stop_message(self, step: int, limit: int) -> str:
        if self._no_checkpoint:
            what = (
                f"kept coming at step {step} ({limit} rollback(s) in a row were called for, "
                "but there is no committed checkpoint to go back to: save_state with "
                "ProjectConfiguration(automatic_checkpoint_naming=True) makes one)"
            )
        else:
            what = (
                f"came back at step {step} after {limit} rollback(s) in a row that made no progress"
            )
        return (
            f"BadStepGuard stopped the run at step {step}: bad steps (non-finite or spiking "
            f"loss or gradients) {what}; {self.rollbacks} rollback(s) and {self.skipped_steps} "
            f"skipped step(s) in the whole run, {len(self.offending)} batch(es) left out. "
            "Leaving out more batches does not help when the divergence is not caused by the "
            "data: lower the learning rate or warm it up longer, clip gradients "
            "(accelerator.clip_grad_norm_), use bf16 instead of fp16, or check the model "
            "for an unstable operation; resume from the last checkpoint once changed. To "
            "allow more attempts: BadStepGuard(max_rollbacks_without_progress="
            f"{limit * 2})"
        )

    # -- the data ------------------------------------------------------------------------
    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of one pass of ``loader``, without the offending ones; after a
        rollback the pass starts again at the checkpoint's position."""
        while True:
            self.rolled_back = False
            for batch in loader:
                position = _position(loader)
                if position in self.offending:
                    continue
                self._cycle.append(position)
                yield batch
                if self.rolled_back:
                    break
            else:
                return


def _position(loader: Any) -> tuple[int, int]:
    """``(epoch, batches yielded)`` of a prepared dataloader right after it yielded a batch."""
    return int(getattr(loader, "epoch", 0) or 0), int(getattr(loader, "batches_yielded", 0))


def _non_finite_gradients(accelerator: Any) -> float:
    """1.0 when a gradient this process holds (its shard, under FSDP2/TP) has a NaN or inf."""
    grads = [
        getattr(p.grad, "_local_tensor", p.grad)
        for optimizer in accelerator._optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return 0.0 if bool(torch.isfinite(torch.stack(norms).sum())) else 1.0
