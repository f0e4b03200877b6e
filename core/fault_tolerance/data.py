"""A data loader for fault-tolerant training: every step, the samples of the next global
batch are dealt to the data-parallel processes of the groups in the quorum, so the live
groups never share a sample and no sample is skipped.

The position in an epoch is a cursor into the epoch's (seeded) order of samples: a step
hands process ``i`` of ``n`` the ``batch_size`` samples starting at ``cursor + i *
batch_size``, and a committed step moves the cursor by ``n * batch_size``. A discarded step
moves it back, so its samples are trained on again; a group that rejoins copies the
cursor. ``committed_samples`` counts the samples of this epoch the job has trained on.
In semi-synchronous training a step is an interval of several batches, which may cross
into the next epoch: the epoch and cursor move on batch by batch and are committed (or
put back) with the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data._utils.collate import default_collate

from ..runtime.tree import map_tensors


class FaultTolerantDataLoader:
    """Batches of ``loader``'s dataset dealt out over the quorum (see the module docstring).

    Samples are read in the training process (the loader's workers are not used). A pass
    (``for batch in loader``) ends with the epoch; a group that rejoined continues the
    epoch the others are in, so loop with ``while loader.epoch < epochs: for batch in
    loader: ...`` or count steps, not passes.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        controller: Any,
        *,
        device: torch.device | None,
        seed: int | None = None,
    ) -> None:
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError(
                "fault tolerance deals the samples of a map-style Dataset to the live replica "
                "groups; an IterableDataset cannot be dealt that way: wrap the data in a "
                "map-style Dataset (with __len__ and __getitem__)"
            )
        if loader.batch_size is None:
            raise ValueError(
                "fault tolerance needs a DataLoader with batch_size=N (the per-process batch)"
            )
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size)
        self.collate_fn: Callable[[list[Any]], Any] = loader.collate_fn or default_collate
        self.shuffle = isinstance(loader.sampler, RandomSampler)
        self.controller = controller
        self.device = device
        if seed is None:  # Accelerate's (and prepared loaders') seed: what set_seed set
            seed = torch.initial_seed()
        self.seed = seed
        #: The epoch the batches come from (ahead of the committed one inside a
        #: semi-synchronous interval that crossed into the next epoch).
        self.epoch = 0
        self._committed_epoch = 0
        #: Samples of the committed epoch trained on by committed steps.
        self.committed_samples = 0
        self._pending = 0  # the cursor while a step is open
        #: The sample indices of this process's current batch (repeats left out).
        self.batch_indices: list[int] = []
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def num_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def epoch_dealt(self) -> bool:
        """Whether every sample of the epoch has been dealt: the open step holds the last
        ones (the epoch ends once it commits; a discarded step deals them again)."""
        return self._pending >= self.num_samples

    def __len__(self) -> int:
        """Steps per epoch with every replica group alive."""
        return math.ceil(self.num_samples / (self.batch_size * self._full_world()))

    def _full_world(self) -> int:
        view = self.controller.state.data_parallel
        return view.num_processes * self.controller.replica_groups

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            self._order = (self.epoch, order)
        return self._order[1]

    def __iter__(self) -> Iterator[Any]:
        while True:
            if self._pending >= self.num_samples:
                # After the epoch's last step: the same on every group.
                self.epoch += 1
                self._pending = 0
                if not self.controller.step_open:  # (else the open interval commits it)
                    self._committed_epoch, self.committed_samples = self.epoch, 0
                return
            self.controller.begin_step()  # a rejoining group copies the position here
            index, count = self.controller.data_coordinates()
            order = self._epoch_order()
            start = self._pending + index * self.batch_size
            real = order[start : min(start + self.batch_size, self.num_samples)].tolist()
            indices = list(real)
            while len(indices) < self.batch_size:  # the epoch's end: repeat from its start
                indices.append(int(order[len(indices) - len(real)].item()))
            self.batch_indices = real
            self._pending = min(self.num_samples, self._pending + count * self.batch_size)
            batch = self.collate_fn([self.dataset[i] for i in indices])
            yield self._place(batch)

    def _place(self, batch: Any) -> Any:
        device = self.device
        if device is None:
            return batch
        return map_tensors(lambda t: t.to(device), batch)

    def finish_step(self, committed: bool) -> None:
        """The open step was applied (move the cursor on) or discarded (move it back)."""
        if committed:
            self._committed_epoch, self.committed_samples = self.epoch, self._pending
        else:
            self.epoch, self._pending = self._committed_epoch, self.committed_samples

    # -- the position, for rejoining groups and checkpoints ---------------------------------
    def position(self) -> dict[str, int]:
        return {"epoch": self._committed_epoch, "cursor": self.committed_samples, "seed": self.seed}

    def load_position(self, position: dict[str, int]) -> None:
        self.epoch = self._committed_epoch = int(position["epoch"])
        self.committed_samples = self._pending = int(position["cursor"])
        self.seed = int(position["seed"])

    def state_dict(self) -> dict[str, int]:
        return self.position()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.load_position(state)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = self._committed_epoch = epoch
            self.committed_samples = self._pending = 0
