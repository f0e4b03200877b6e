"""Sharding for ``IterableDataset``: every rank reads the stream and keeps its slice.

Example::

    shard = IterableDatasetShard(stream, batch_size=4, num_processes=2, process_index=1)
    # samples 4..7 of each 8, then of the next 8, ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import IterableDataset

from .samplers import _complete, check_shard_arguments


class ShardedIterable(IterableDataset[Any]):
    """What every way of taking one rank's share of an iterable dataset holds: the batch
    arithmetic, the options and the epoch (:class:`IterableDatasetShard` reads the whole
    stream; a stream that shards itself reads only its part, see ``streaming.py``)."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
        drop_last: bool = False,
    ) -> None:
        check_shard_arguments(num_processes, process_index, split_batches, batch_size)
        self.dataset = dataset
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last = drop_last
        self.global_batch_size = batch_size if split_batches else batch_size * num_processes
        self.per_process = self.global_batch_size // num_processes
        #: Real samples in the final, incomplete global batch of the last pass (or None).
        self.final_real_samples: int | None = None
        self.epoch = 0
        #: The first global batch of this pass (completes a short final one).
        self.initial: list[Any] = []
        #: ``initial`` of a pass resumed from a saved state.
        self.restored_initial: list[Any] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class IterableDatasetShard(ShardedIterable):
    """This rank's samples of an iterable dataset shared by ``num_processes`` ranks.

    The stream is cut into global batches of ``batch_size * num_processes`` samples (or
    ``batch_size`` with ``split_batches``); rank ``r`` keeps the ``r``-th slice of each. A
    short final global batch is completed from the first samples (``even_batches``),
    dropped (``drop_last``), or split as it is.
    """

    def _slice(self, buffer: list[Any]) -> list[Any]:
        start = self.process_index * self.per_process
        return buffer[start : start + self.per_process]

    def __iter__(self) -> Iterator[Any]:
        self.final_real_samples = None
        self.initial, self.restored_initial = self.restored_initial, []
        buffer: list[Any] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == self.global_batch_size:
                if not self.initial:
                    self.initial = list(buffer)
                yield from self._slice(buffer)
                buffer = []
        if not buffer or self.drop_last:
            return
        self.final_real_samples = len(buffer)
        if self.num_processes == 1:
            yield from buffer
            return
        if self.even_batches:
            completion = self.initial or buffer
            yield from self._slice(_complete(buffer, self.global_batch_size, completion))
        else:
            size = math.ceil(len(buffer) / self.num_processes)
            start = self.process_index * size
            yield from buffer[start : start + size]

    def __len__(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError("the wrapped dataset has no length")
        total = len(self.dataset)
        full, rest = divmod(total, self.global_batch_size)
        count = full * self.per_process
        if rest and not self.drop_last:
            if self.even_batches or self.num_processes == 1:
                count += self.per_process if self.num_processes > 1 else rest
            else:
                size = math.ceil(rest / self.num_processes)
                count += max(0, min(size, rest - self.process_index * size))
        return count
