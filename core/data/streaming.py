"""Streams that shard themselves: each process reads only its part of an ``IterableDataset``.

Plain iterable datasets are read whole by every process, each keeping its slice
(:class:`~slipstream.data.iterable.IterableDatasetShard`): exact, but reading grows with the
number of processes. A dataset that can split its source does better: a Hugging Face
``datasets.IterableDataset`` with at least as many shards (files) as processes, or any
object with the documented protocol::

    dataset.shard(num_shards, index)   # -> an iterable over part `index` of `num_shards`

Each process then reads its own part once. The parts may hold different numbers of
samples, so before every batch the processes agree (one small all-reduce) whether anyone
still has samples: a process whose part ran out completes its batches from its first
samples until everyone is done, and records how many rows of each batch are real, so
``gather_for_metrics`` counts every sample exactly once (``even_batches``, the default).
Without ``even_batches`` each process stops when its part ends (processes may take
different numbers of steps, as for map-style datasets).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .iterable import ShardedIterable
from .samplers import _complete

if TYPE_CHECKING:
    from ..runtime.state import ProcessState


def can_shard_itself(dataset: Any, num_shards: int) -> bool:
    """Whether ``dataset`` can hand each of ``num_shards`` processes its own part."""
    if num_shards < 2 or not callable(getattr(dataset, "shard", None)):
        return False
    n_shards = getattr(dataset, "n_shards", None)  # Hugging Face datasets: its source files
    return n_shards is None or int(n_shards) >= num_shards


def _part(dataset: Any, num_shards: int, index: int) -> Any:
    try:
        return dataset.shard(num_shards=num_shards, index=index)
    except TypeError:
        return dataset.shard(num_shards, index)


class SelfShardedStream(ShardedIterable):
    """This process's part of a dataset that shards itself (see the module docstring)."""

    def __init__(self, dataset: Any, *, state: ProcessState, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.state = state
        #: Real rows of each batch this pass produced and the loader has not yet yielded
        #: (``None``: all rows real), in order.
        self.real_rows: collections.deque[int | None] = collections.deque()

    def _agree(self, rows: int, empty: bool) -> tuple[int, int, int]:
        """The most and fewest rows any process has for this batch, and the highest index
        of a process whose part had no sample at all (-1: none)."""
        mark = self.process_index if empty else -1
        if self.num_processes == 1:
            return rows, rows, mark
        import torch.distributed as dist

        group = self.state.data_parallel
        values = torch.tensor([rows, -rows, mark], dtype=torch.int64, device=self.state.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group.group)
        return int(values[0]), -int(values[1]), int(values[2])

    def __iter__(self) -> Iterator[Any]:
        self.final_real_samples = None
        self.real_rows.clear()
        samples = iter(_part(self.dataset, self.num_processes, self.process_index))
        first: list[Any] = []
        while True:
            batch = list(itertools.islice(samples, self.per_process))
            first = first or batch
            if not self.even_batches:
                if not batch or (self.drop_last and len(batch) < self.per_process):
                    return
                self.real_rows.append(None)
                yield from batch
                continue
            most, fewest, empty = self._agree(len(batch), not first)
            if most == 0 or (self.drop_last and fewest < self.per_process):
                return
            if empty >= 0:  # raised by every process alike, so none waits for the others
                raise ValueError(
                    f"process {empty}'s part of the dataset is empty, so it has nothing to "
                    "complete its batches with; give the dataset at least as many non-empty "
                    "shards as there are data-parallel processes"
                )
            # When any process completes its batch, every process says how many of its rows
            # are real (all of them, maybe): gathering must take the same path everywhere.
            self.real_rows.append(None if fewest == self.per_process else len(batch))
            yield from _complete(batch, self.per_process, first)

    def __len__(self) -> int:
        raise TypeError("a dataset that shards itself has no known length per process")
