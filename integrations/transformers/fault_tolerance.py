"""transformers' Trainer under slipstream's fault tolerance: its steps are the job's
committed steps, its epochs the fault-tolerant loader's.

Under fault tolerance (``slipstream launch --fault_tolerance``) a step is applied only if
every replica group of its quorum votes to commit it: a step during which a group is lost
is discarded (its samples are dealt again), and a restarted group heals from a live one,
taking its weights, its place in the data and its step count. The Trainer counts steps and
epochs itself; here they follow the job instead:

* ``state.global_step`` is the job's committed step count (``manager.current_step()``): a
  discarded step does not count and its loss is not logged; a healed group goes on from
  the job's step (its first logged loss and its ``train_loss`` cover its own steps).
  ``max_steps`` (given, or derived from the epochs with every group alive) is therefore
  reached with that many committed steps, by every group at the same step.
* an epoch lasts until the loader has dealt all its samples (a lost group leaves larger
  shares to the others; a discarded step deals its samples again); the micro-batch that
  deals the last ones ends the step, and the loader keeps its own epoch count (a healed
  group's loader is in the job's epoch). Epochs go on until ``max_steps``; ``state.epoch``
  is the loader's epoch and the fraction of its samples committed, alike in every group.
* ``resume_from_checkpoint`` is refused (the Trainer's checkpoint holds neither the job's
  step nor the loader's position).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import transformers


class EpochTracker:
    """Where the Trainer's loop is in the loader's epoch: micro-batches fetched since the
    epoch started, and which of them dealt the epoch's last samples (None until then)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.fetched = 0
        self.last: int | None = None

    def start(self) -> None:
        self.fetched, self.last = 0, None

    def fetch(self, iterator: Iterator[Any], wanted: int) -> list[Any]:
        """Up to ``wanted`` micro-batches for one step, fewer where the epoch's samples run
        out: the step ends with them. Nothing past them is asked for until the step is
        resolved (asking would end the loader's epoch before a discarded step deals them
        again)."""
        batches: list[Any] = []
        while len(batches) < wanted:
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
            self.fetched += 1
            self.last = self.fetched if self.loader.epoch_dealt else None
            if self.last is not None:
                break
        return batches


class EpochLength(int):
    """``steps_in_epoch`` as the Trainer's epoch loop reads it under fault tolerance. As a
    number (arithmetic, the fraction of an epoch it logs) it is the count with every group
    alive; compared with ``==`` (the loop's test for the epoch's last micro-batch, which
    steps the optimizer after a short accumulation cycle) it equals the micro-batch that
    dealt the loader's last samples, once there is one."""

    tracker: EpochTracker

    def __new__(cls, value: int, tracker: EpochTracker) -> EpochLength:
        made = super().__new__(cls, value)
        made.tracker = tracker
        return made

    def __eq__(self, other: object) -> bool:
        return self.tracker.last is not None and other == self.tracker.last

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = int.__hash__


class LoaderView:
    """The fault-tolerant loader without ``set_epoch``: the Trainer's epoch number would
    reset the loader's own (the job's) epoch and position."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class CommittedSteps(transformers.TrainerCallback):
    """Sets ``state.global_step`` to the job's committed steps at every step's end, before
    the Trainer's own callbacks decide on logging, saving and stopping (it runs first)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)
        self._loss_before: torch.Tensor | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            self._loss_before = trainer._tr_loss.detach().clone()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None:
            return
        counted = state.global_step - 1  # before the Trainer counted this step
        committed = trainer.accelerator.fault_tolerance.current_step()
        if committed <= counted and self._loss_before is not None:
            # Discarded: its loss joins no logged step.
            trainer._tr_loss.copy_(self._loss_before)
        elif committed > counted + 1:
            # Healed from a peer: the job's steps before this one are not this run's, so
            # its first logged loss and its train_loss are divided by its own steps.
            trainer._globalstep_last_logged += committed - counted - 1
            trainer._initial_global_step += committed - counted - 1
        state.global_step = committed
        tracker = trainer._fault_tolerant.tracker if trainer._fault_tolerant else None
        if tracker is not None:  # the job's epoch: the loader's, with its committed samples
            loader = tracker.loader
            state.epoch = loader.epoch + loader.committed_samples / loader.num_samples


class FaultTolerantTraining:
    """What a Trainer under fault tolerance changes in its loop (see the module doc)."""

    def __init__(self, trainer: Any) -> None:
        self.tracker: EpochTracker | None = None
        trainer.callback_handler.callbacks.insert(0, CommittedSteps(trainer))

    def training_values(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """``set_initial_training_values``' result with epochs going on until max_steps."""
        return (sys.maxsize, *values[1:])

    def epoch_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``_run_epoch``'s keyword arguments: the loader's epoch, not the Trainer's."""
        loader = arguments["train_dataloader"]
        if not hasattr(loader, "epoch_dealt"):
            return arguments  # not slipstream's fault-tolerant loader
        self.tracker = EpochTracker(loader)
        return {
            **arguments,
            "train_dataloader": LoaderView(loader),
            "steps_in_epoch": EpochLength(arguments["steps_in_epoch"], self.tracker),
            "num_update_steps_per_epoch": sys.maxsize,
        }

    def batches(self, trainer: Any, iterator: Iterator[Any], wanted: int) -> list[Any]:
        """One step's micro-batches; none ends the Trainer's epoch (the loader's ended)."""
        assert self.tracker is not None, "epoch_arguments comes first"
        batches = self.tracker.fetch(iterator, wanted)
        if not batches:
            trainer.control.should_epoch_stop = True
        return batches
